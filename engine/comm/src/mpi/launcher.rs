//! [`MpiLauncher`]: runs the conformance suite's per-rank bodies on the processes of an MPI job.

use super::{Handle, MpiComm, MpiUniverse};
use crate::codec;
use crate::conformance::{Launcher, RankBody, RankResult};
use crate::error::CommError;
use crate::topology::Topology;
use mpi::ffi;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

/// A [`Launcher`] for the MPI backend, used by a test program started with `mpirun -n N`.
///
/// Every process of the job runs the same check (the same sequence of `launch` calls). A launch
/// of a topology with `W <= N` ranks builds a fresh [`MpiComm`] world from the first `W`
/// processes ([`MpiComm::split_world`]), runs the body on each of them (a panic becomes
/// [`CommError::RankPanicked`] for that rank and an abort notice for its peers), then every
/// process of the job receives every rank's result (values or the encoded error), so all
/// processes evaluate the check identically. Topologies larger than the job are reported by
/// [`Launcher::max_world_size`] so the checks skip them.
pub struct MpiLauncher {
    universe: Arc<MpiUniverse>,
    /// A private duplicate of `MPI_COMM_WORLD` for the result exchange.
    results: Handle,
}

// SAFETY: the handle is only used by `launch`, which every process calls from one thread at a
// time (the conformance checks are sequential).
unsafe impl Sync for MpiLauncher {}
// SAFETY: as above.
unsafe impl Send for MpiLauncher {}

impl std::fmt::Debug for MpiLauncher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiLauncher")
            .field("universe", &self.universe)
            .finish()
    }
}

impl MpiLauncher {
    /// A launcher over every process of the job. Collective over `MPI_COMM_WORLD`.
    pub fn new(universe: Arc<MpiUniverse>) -> MpiLauncher {
        let mut c: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: MPI is initialised (the universe exists); out-pointer valid.
        unsafe { ffi::MPI_Comm_dup(universe.world_handle(), &mut c) };
        MpiLauncher {
            universe,
            results: Handle(c),
        }
    }

    /// The universe (job rank and size).
    pub fn universe(&self) -> &Arc<MpiUniverse> {
        &self.universe
    }

    /// Every process's bytes, in job-rank order (blocking `MPI_Allgather` + `MPI_Allgatherv`).
    fn exchange(&self, mine: &[u8]) -> Vec<Vec<u8>> {
        let n = self.universe.size();
        let comm = self.results.0;
        let len = mine.len() as u64;
        let mut lens = vec![0u64; n];
        // SAFETY: buffers sized for n processes; blocking collectives on a live communicator.
        unsafe {
            ffi::MPI_Allgather(
                &len as *const u64 as *const c_void,
                1,
                ffi::RSMPI_UINT64_T,
                lens.as_mut_ptr() as *mut c_void,
                1,
                ffi::RSMPI_UINT64_T,
                comm,
            );
        }
        let total: u64 = lens.iter().sum();
        assert!(
            total <= c_int::MAX as u64,
            "conformance results of {total} bytes exceed one MPI message"
        );
        let counts: Vec<c_int> = lens.iter().map(|&l| l as c_int).collect();
        let mut displs = vec![0 as c_int; n];
        for i in 1..n {
            displs[i] = displs[i - 1] + counts[i - 1];
        }
        let mut all = vec![0u8; total as usize];
        unsafe {
            ffi::MPI_Allgatherv(
                mine.as_ptr() as *const c_void,
                mine.len() as c_int,
                ffi::RSMPI_UINT8_T,
                all.as_mut_ptr() as *mut c_void,
                counts.as_ptr(),
                displs.as_ptr(),
                ffi::RSMPI_UINT8_T,
                comm,
            );
        }
        (0..n)
            .map(|i| all[displs[i] as usize..(displs[i] + counts[i]) as usize].to_vec())
            .collect()
    }
}

impl Drop for MpiLauncher {
    fn drop(&mut self) {
        // SAFETY: duplicated in `new`, freed once.
        unsafe { ffi::MPI_Comm_free(&mut self.results.0) };
    }
}

fn decode_result(rank: usize, b: &[u8]) -> RankResult {
    codec::decode_result(b).unwrap_or_else(|| {
        Err(CommError::Unsupported {
            backend: "mpi",
            what: format!("rank {rank}'s result ({} bytes) cannot be decoded", b.len()),
        })
    })
}

impl Launcher for MpiLauncher {
    fn name(&self) -> &str {
        "mpi"
    }

    fn max_world_size(&self) -> usize {
        self.universe.size()
    }

    fn launch(&self, topology: Topology, timeout: Duration, body: RankBody<'_>) -> Vec<RankResult> {
        let w = topology.world_size;
        let mine: Option<RankResult> = match MpiComm::split_world(&self.universe, topology, timeout)
        {
            Err(e) => return (0..w.max(1)).map(|_| Err(e.clone())).collect(),
            Ok(None) => None,
            Ok(Some(comm)) => {
                let rank = self.universe.rank();
                let r = match catch_unwind(AssertUnwindSafe(|| body(&comm))) {
                    Ok(r) => r,
                    Err(p) => {
                        let message = crate::thread::panic_message(&*p);
                        comm.fail(CommError::PeerFailed {
                            peer: rank,
                            reason: format!("rank {rank} panicked: {message}"),
                        });
                        Err(CommError::RankPanicked { rank, message })
                    }
                };
                drop(comm);
                Some(r)
            }
        };
        let bytes = mine.as_ref().map(codec::encode_result).unwrap_or_default();
        let all = self.exchange(&bytes);
        (0..w).map(|r| decode_result(r, &all[r])).collect()
    }
}
