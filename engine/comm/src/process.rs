//! Communicators for a process that is one rank of a multi-process job, built the same way
//! with or without the optional backends compiled in, so callers (the `fsdp` CLI) need no
//! feature gates of their own.

use crate::comm::Communicator;
use crate::error::CommError;
use crate::topology::Topology;
use std::time::Duration;

/// Whether this build has the NCCL backend (the `cuda` feature): callers refuse
/// `--backend nccl` up front without it.
pub const NCCL_BUILT: bool = cfg!(feature = "cuda");

/// The NCCL backend for this process, bootstrapped from torchrun's environment (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK` selecting the GPU, `MASTER_ADDR`, `MASTER_PORT`; `fsdp launch`
/// sets them): rank 0 creates the NCCL unique id and shares it through the TCP rendezvous,
/// every rank joins the world of `topology` on device `LOCAL_RANK`, and the shard and replicate
/// groups are split from it (see the `nccl` module). `timeout` bounds the bootstrap and every
/// collective; call descriptions are exchanged before every collective (mismatch detection).
///
/// Errors: [`CommError::Env`] / [`CommError::Rendezvous`] / [`CommError::InvalidTopology`] /
/// [`CommError::Device`] from the bootstrap; [`CommError::Unsupported`] when this binary was
/// built without the `cuda` feature (the message says how to rebuild).
pub fn nccl_from_env(
    topology: Topology,
    timeout: Duration,
) -> Result<Box<dyn Communicator>, CommError> {
    #[cfg(feature = "cuda")]
    {
        let opts = crate::nccl::NcclOptions {
            timeout,
            ..Default::default()
        };
        let (comm, _rendezvous) = crate::nccl::NcclComm::from_env(topology, opts)?;
        Ok(Box::new(comm))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (topology, timeout);
        Err(CommError::Unsupported {
            backend: "nccl",
            what: "this binary was built without the `cuda` feature; rebuild with \
                   `cargo build --release --features cuda` (see gpu/README.md)"
                .into(),
        })
    }
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    #[test]
    fn nccl_without_cuda_feature_says_how_to_rebuild() {
        let topo = Topology::fully_sharded(2).unwrap();
        match nccl_from_env(topo, Duration::from_secs(1)) {
            Err(CommError::Unsupported { backend, what }) => {
                assert_eq!(backend, "nccl");
                assert!(what.contains("--features cuda"), "{what}");
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("an NCCL communicator without the cuda feature"),
        }
    }
}
