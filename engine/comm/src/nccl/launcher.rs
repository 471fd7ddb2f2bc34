//! [`NcclLauncher`]: runs the conformance suite's per-rank bodies on NCCL communicators, either
//! one rank in this process (world size 1) or one rank per process of a job started by
//! `fsdp launch --nproc P` (torchrun's environment; the job's rendezvous carries each launch's
//! unique id and every rank's result).

use super::{NcclComm, NcclId, NcclOptions};
use crate::codec;
use crate::conformance::{Launcher, RankBody, RankResult};
use crate::error::CommError;
use crate::rendezvous::{LaunchEnv, Rendezvous};
use crate::topology::Topology;
use cudarc::driver::CudaContext;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use std::time::Duration;

/// Environment variable: when set (to any prefix, e.g. `fsdp`), [`NcclLauncher::from_env`] sets
/// `NCCL_HOSTID=<prefix>-<RANK>` before NCCL starts, so several processes on ONE GPU form a
/// real multi-rank NCCL world (NCCL refuses two ranks of one communicator on the same device
/// and host; a distinct host id per process makes it connect them over sockets instead). Use
/// with `NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1`; for tests only (slow, ~2 GB/s).
pub const NCCL_HOSTID_PER_RANK: &str = "FSDP_NCCL_HOSTID_PER_RANK";

enum Mode {
    /// One rank, in this process.
    Single,
    /// This process is `rank` of `procs` processes joined by `rv`.
    Processes {
        rank: usize,
        procs: usize,
        rv: Mutex<Rendezvous>,
    },
}

/// A conformance [`Launcher`] for the NCCL backend. Every launch builds a fresh NCCL world
/// (a new unique id) of the topology's size on device `device` and runs the body on it; a
/// panicking body becomes [`CommError::RankPanicked`] for its rank.
pub struct NcclLauncher {
    mode: Mode,
    device: usize,
    opts: NcclOptions,
}

impl std::fmt::Debug for NcclLauncher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLauncher")
            .field("device", &self.device)
            .field("max_world_size", &self.max_world_size())
            .finish()
    }
}

impl NcclLauncher {
    /// One rank in this process on CUDA device `device`: runs the world-size-1 checks.
    pub fn single(device: usize, opts: NcclOptions) -> NcclLauncher {
        NcclLauncher {
            mode: Mode::Single,
            device,
            opts,
        }
    }

    /// This process as one rank of a job started by `fsdp launch` (or torchrun): reads
    /// [`LaunchEnv`], joins the rendezvous, uses device `LOCAL_RANK` — or device 0 for every
    /// process when [`NCCL_HOSTID_PER_RANK`] is set (processes sharing one GPU), in which case
    /// it also sets `NCCL_HOSTID`. Every process of the job must run the same checks in the
    /// same order.
    ///
    /// Errors: [`CommError::Env`], [`CommError::Rendezvous`].
    pub fn from_env(opts: NcclOptions) -> Result<NcclLauncher, CommError> {
        let env = LaunchEnv::from_env()?;
        let shared_gpu = std::env::var(NCCL_HOSTID_PER_RANK).ok();
        if let Some(prefix) = &shared_gpu {
            // Before any NCCL call of this process; the variable is read by NCCL at init.
            std::env::set_var("NCCL_HOSTID", format!("{prefix}-{}", env.rank));
        }
        let rv = Rendezvous::connect(&env, Duration::from_secs(120))?;
        Ok(NcclLauncher {
            mode: Mode::Processes {
                rank: env.rank,
                procs: env.world_size,
                rv: Mutex::new(rv),
            },
            device: if shared_gpu.is_some() {
                0
            } else {
                env.local_rank
            },
            opts,
        })
    }

    /// This process's rank in the job (0 for [`NcclLauncher::single`]).
    pub fn process_rank(&self) -> usize {
        match &self.mode {
            Mode::Single => 0,
            Mode::Processes { rank, .. } => *rank,
        }
    }

    /// Builds this rank's communicator and runs `body` on it; returns the result and the
    /// communicator, which the caller drops only after every rank finished (a rank that tore
    /// its communicator down early could cut a peer's last transfer short).
    fn run_rank(
        &self,
        rank: usize,
        topology: Topology,
        id: &NcclId,
        timeout: Duration,
        body: RankBody<'_>,
    ) -> (RankResult, Option<NcclComm>) {
        match self.try_run_rank(rank, topology, id, timeout, body) {
            Ok((r, c)) => (r, Some(c)),
            Err(e) => (Err(e), None),
        }
    }

    fn try_run_rank(
        &self,
        rank: usize,
        topology: Topology,
        id: &NcclId,
        timeout: Duration,
        body: RankBody<'_>,
    ) -> Result<(RankResult, NcclComm), CommError> {
        let ctx = CudaContext::new(self.device).map_err(|e| {
            super::raw::cuda_error(
                rank,
                &format!("cuDevicePrimaryCtxRetain(device {})", self.device),
                e,
            )
        })?;
        // Creating the world may take longer than a check's short call timeout (NCCL's
        // bootstrap over sockets): give it at least 2 minutes, then use the check's timeout.
        let opts = NcclOptions {
            timeout: timeout.max(Duration::from_secs(120)),
            ..self.opts
        };
        let mut comm = NcclComm::new(ctx, rank, topology, id, opts)?;
        comm.set_timeout(timeout);
        let r = match catch_unwind(AssertUnwindSafe(|| body(&comm))) {
            Ok(r) => r,
            Err(p) => Err(CommError::RankPanicked {
                rank,
                message: crate::thread::panic_message(&*p),
            }),
        };
        Ok((r, comm))
    }
}

impl Launcher for NcclLauncher {
    fn name(&self) -> &str {
        "nccl"
    }

    /// This process's CUDA device as a candle device (the tensor checks run on CUDA tensors in
    /// place).
    fn tensor_device(&self) -> Result<candle_core::Device, String> {
        candle_core::Device::new_cuda(self.device).map_err(|e| e.to_string())
    }

    fn max_world_size(&self) -> usize {
        match &self.mode {
            Mode::Single => 1,
            Mode::Processes { procs, .. } => *procs,
        }
    }

    fn launch(&self, topology: Topology, timeout: Duration, body: RankBody<'_>) -> Vec<RankResult> {
        let w = topology.world_size;
        match &self.mode {
            Mode::Single => {
                if w != 1 {
                    let e = CommError::Unsupported {
                        backend: "nccl",
                        what: format!("a single-process launcher runs world size 1, not {w}"),
                    };
                    return (0..w.max(1)).map(|_| Err(e.clone())).collect();
                }
                let r =
                    NcclId::new(0).and_then(|id| self.run_rank(0, topology, &id, timeout, body).0);
                vec![r]
            }
            Mode::Processes { rank, procs, rv } => {
                let mut rv = rv.lock().unwrap_or_else(|p| p.into_inner());
                let fail_all = |e: CommError| (0..w).map(|_| Err(e.clone())).collect();
                if w > *procs {
                    return fail_all(CommError::Unsupported {
                        backend: "nccl",
                        what: format!("world size {w} needs {w} processes, the job has {procs}"),
                    });
                }
                // Rank 0 names the new world; every process learns the id (or rank 0's error).
                // An empty message tells the others that rank 0 could not create the id.
                let mut id_err = None;
                let id_bytes = if *rank == 0 {
                    let mine = match NcclId::new(0) {
                        Ok(id) => id.0.to_vec(),
                        Err(e) => {
                            id_err = Some(e);
                            Vec::new()
                        }
                    };
                    rv.broadcast_bytes(Some(&mine))
                } else {
                    rv.broadcast_bytes(None)
                };
                if let Some(e) = id_err {
                    return fail_all(e);
                }
                let id = match id_bytes.and_then(|b| {
                    if b.is_empty() {
                        Err(CommError::PeerFailed {
                            peer: 0,
                            reason: "rank 0 could not create the NCCL unique id".into(),
                        })
                    } else {
                        NcclId::from_bytes(&b)
                    }
                }) {
                    Ok(id) => id,
                    Err(e) => return fail_all(e),
                };
                let (mine, comm) = if *rank < w {
                    let (r, c) = self.run_rank(*rank, topology, &id, timeout, body);
                    (Some(r), c)
                } else {
                    (None, None)
                };
                let bytes = mine.as_ref().map(codec::encode_result).unwrap_or_default();
                let all = rv.all_gather_bytes(&bytes);
                drop(comm); // every rank is done with this world
                match all {
                    Ok(all) => (0..w)
                        .map(|r| {
                            if r == *rank {
                                mine.clone().expect("own rank ran")
                            } else {
                                decode_result(r, &all[r])
                            }
                        })
                        .collect(),
                    Err(e) => fail_all(e),
                }
            }
        }
    }
}

/// Rank `rank`'s result from its bytes ([`codec::encode_result`]); an empty or undecodable
/// message is an error naming the rank.
fn decode_result(rank: usize, b: &[u8]) -> RankResult {
    codec::decode_result(b).unwrap_or_else(|| {
        Err(CommError::PeerFailed {
            peer: rank,
            reason: format!("rank {rank}'s result ({} bytes) cannot be decoded", b.len()),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undecodable_result_names_its_rank() {
        assert!(matches!(
            decode_result(4, &[]),
            Err(CommError::PeerFailed { peer: 4, .. })
        ));
        let ok = codec::encode_result(&Ok(vec![1.5]));
        assert_eq!(decode_result(0, &ok), Ok(vec![1.5]));
        assert!(matches!(
            decode_result(2, &ok[..ok.len() - 1]),
            Err(CommError::PeerFailed { peer: 2, .. })
        ));
    }
}
