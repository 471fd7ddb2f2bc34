//! This process as one rank of a multi-process job: an NCCL job started by `fsdp launch`
//! (torchrun's environment) or an MPI job (`mpirun`), with the communicator factory each
//! trains over and, under MPI, the table of every rank's host memory the pre-flight reads.

use crate::error::RunError;
use crate::memory::CountingAllocator;
use crate::options::TrainOptions;
use crate::run::PreparedRun;
use crate::train::{train_prepared, StepReport};

/// `--backend nccl`: this process as one rank of an NCCL job started by `fsdp launch` (or
/// torchrun), from its environment.
pub struct NcclProcess {
    rank: usize,
    timeout: std::time::Duration,
}

impl NcclProcess {
    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Reads torchrun's environment and sets `opts.world_size` to `WORLD_SIZE`.
    ///
    /// Errors: [`RunError::Refused`] without a launcher's environment, when `--world-size`
    /// (other than its default 1) disagrees with it, or for a bad `--comm-timeout`.
    pub fn init(
        world_size_flag: usize,
        comm_timeout: f64,
        opts: &mut TrainOptions,
    ) -> Result<NcclProcess, RunError> {
        let timeout = comm_timeout_arg(comm_timeout)?;
        let env = fsdp_comm::rendezvous::LaunchEnv::from_env().map_err(|e| {
            RunError::Refused(format!(
                "--backend nccl runs one process per GPU under a launcher: `fsdp launch --nproc N -- train --device cuda --backend nccl ...` ({e})"
            ))
        })?;
        if world_size_flag != 1 && world_size_flag != env.world_size {
            return Err(RunError::Refused(format!(
                "--world-size {world_size_flag} disagrees with WORLD_SIZE={} of the launcher; with --backend nccl the world size is the launcher's --nproc (omit --world-size)",
                env.world_size
            )));
        }
        opts.world_size = env.world_size;
        if !fsdp_comm::NCCL_BUILT {
            return Err(RunError::Refused(
                "--backend nccl: this fsdp binary was built without CUDA support; rebuild with \
                 `cargo build --release --features cuda` (see gpu/README.md)"
                    .into(),
            ));
        }
        Ok(NcclProcess {
            rank: env.rank,
            timeout,
        })
    }

    /// Trains as this rank over an NCCL communicator (`fsdp_comm::nccl_from_env`).
    pub fn train(
        &self,
        run: &PreparedRun,
        alloc: Option<&'static CountingAllocator>,
        hooks: &dyn crate::train::TrainHooks,
        progress: &(dyn Fn(&StepReport) + Sync),
    ) -> crate::error::Result<crate::train::TrainReport> {
        let timeout = self.timeout;
        let factory = move |t: fsdp_comm::Topology| fsdp_comm::nccl_from_env(t, timeout);
        train_prepared(run, alloc, hooks, progress, Some(&factory))
    }
}

/// Longest `--comm-timeout` / `--grace` accepted, in seconds (about 11.6 days): longer waits
/// are no timeout at all, and a deadline that far out would overflow the clock.
pub const MAX_WAIT_SECONDS: f64 = 1e6;

/// `--comm-timeout` as a duration.
///
/// Errors: [`RunError::Refused`] unless it is a number of seconds in `(0, MAX_WAIT_SECONDS]`.
pub fn comm_timeout_arg(comm_timeout: f64) -> Result<std::time::Duration, RunError> {
    if !(comm_timeout.is_finite() && comm_timeout > 0.0 && comm_timeout <= MAX_WAIT_SECONDS) {
        return Err(RunError::Refused(format!(
            "--comm-timeout must be a positive number of seconds up to {MAX_WAIT_SECONDS:e}, got {comm_timeout}"
        )));
    }
    Ok(std::time::Duration::from_secs_f64(comm_timeout))
}

/// `--backend mpi`: this process as one rank of an MPI job.
pub mod mpi {
    use crate::error::RunError;
    use crate::memory::CountingAllocator;
    use crate::options::TrainOptions;
    use crate::preflight::RankHost;
    use crate::run::PreparedRun;
    use crate::train::{StepReport, TrainHooks, TrainReport};

    /// This process's MPI state: the initialised library (finalised on drop) and its rank.
    pub struct MpiProcess {
        #[cfg(feature = "mpi")]
        universe: std::sync::Arc<fsdp_comm::mpi::MpiUniverse>,
        #[cfg(feature = "mpi")]
        timeout: std::time::Duration,
        rank: usize,
    }

    impl MpiProcess {
        /// Initialises MPI and sets `opts.world_size` to the number of processes;
        /// `comm_timeout` (seconds) bounds every wait for peers.
        ///
        /// Errors: [`RunError::Refused`] when `--world-size` (other than its default 1) disagrees
        /// with the MPI job, `--comm-timeout` is not a positive number, or the binary lacks the
        /// `mpi` feature; [`RunError::Failed`] when MPI cannot be initialised.
        #[cfg(feature = "mpi")]
        pub fn init(
            world_size_flag: usize,
            comm_timeout: f64,
            opts: &mut TrainOptions,
        ) -> Result<MpiProcess, RunError> {
            let timeout = super::comm_timeout_arg(comm_timeout)?;
            let universe = fsdp_comm::mpi::MpiUniverse::init()
                .map_err(|e| RunError::Failed(format!("--backend mpi: {e}")))?;
            let n = universe.size();
            if world_size_flag != 1 && world_size_flag != n {
                return Err(RunError::Refused(format!(
                    "--world-size {world_size_flag} disagrees with the {n} MPI processes of this \
                     job; with --backend mpi the world size is mpirun's -n (omit --world-size)"
                )));
            }
            opts.world_size = n;
            Ok(MpiProcess {
                rank: universe.rank(),
                universe,
                timeout,
            })
        }

        /// Without the `mpi` feature: an error saying how to build with it.
        #[cfg(not(feature = "mpi"))]
        pub fn init(_: usize, _: f64, _: &mut TrainOptions) -> Result<MpiProcess, RunError> {
            Err(RunError::Refused(
                "--backend mpi: this fsdp binary was built without MPI support; rebuild with \
                 `cargo build --release --features mpi` (needs libopenmpi-dev and libclang-dev)"
                    .into(),
            ))
        }

        /// This process's MPI rank.
        pub fn rank(&self) -> usize {
            self.rank
        }

        /// Runs `f` with a communicator over the job's world (dropped after) and a factory
        /// building communicators for other topologies of the same processes (what `fsdp
        /// calibrate --backend mpi` measures and trains its reference jobs with). Collective:
        /// every process calls it.
        ///
        /// Errors: [`RunError::Failed`] when the communicator cannot be built.
        #[cfg(feature = "mpi")]
        pub fn with_world<R>(
            &self,
            f: impl FnOnce(&dyn fsdp_comm::Communicator, crate::train::CommFactory<'_>) -> R,
        ) -> Result<R, RunError> {
            use fsdp_comm::{mpi::MpiComm, CommError, Communicator, Topology};
            let n = self.universe.size();
            let failed = |e: CommError| RunError::Failed(format!("--backend mpi: {e}"));
            let topo = Topology::new(n, 1).map_err(failed)?;
            let comm = MpiComm::world(&self.universe, topo, self.timeout).map_err(failed)?;
            let factory = |t: Topology| -> Result<Box<dyn Communicator>, CommError> {
                Ok(Box::new(MpiComm::world(&self.universe, t, self.timeout)?))
            };
            Ok(f(&comm, &factory))
        }

        /// Without the `mpi` feature no MPI process exists ([`MpiProcess::init`] fails).
        #[cfg(not(feature = "mpi"))]
        pub fn with_world<R>(
            &self,
            f: impl FnOnce(&dyn fsdp_comm::Communicator, crate::train::CommFactory<'_>) -> R,
        ) -> Result<R, RunError> {
            let _ = f;
            Err(RunError::Refused(
                "--backend mpi needs a binary built with --features mpi".into(),
            ))
        }

        /// Every rank's [`RankHost`] in rank order, the same table on every rank: one
        /// all-reduce (sum, f64, rank order) over a world communicator built for it and
        /// dropped before training, of rows that are zero except the caller's own. Collective:
        /// every process calls it.
        ///
        /// Errors: [`RunError::Failed`] when the collective fails (a peer exited or timed out;
        /// the peers get the error too).
        #[cfg(feature = "mpi")]
        pub fn gather_hosts(&self, mine: RankHost) -> Result<Vec<RankHost>, RunError> {
            use fsdp_comm::{mpi::MpiComm, Communicator, Group, ReduceOp, Topology};
            let n = self.universe.size();
            let failed = |e: fsdp_comm::CommError| {
                RunError::Failed(format!(
                    "--backend mpi: rank {}: gathering the ranks' node memory for the pre-flight check: {e}",
                    self.rank
                ))
            };
            let topo = Topology::new(n, 1).map_err(failed)?;
            let comm = MpiComm::world(&self.universe, topo, self.timeout).map_err(failed)?;
            let mut table = vec![0f64; 3 * n];
            table[3 * self.rank..3 * self.rank + 3].copy_from_slice(&mine.encode());
            comm.all_reduce(Group::World, ReduceOp::Sum, (&mut table[..]).into())
                .map_err(failed)?;
            drop(comm);
            Ok(table
                .chunks_exact(3)
                .map(|c| RankHost::decode([c[0], c[1], c[2]]))
                .collect())
        }

        /// Without the `mpi` feature no MPI process exists ([`MpiProcess::init`] fails).
        #[cfg(not(feature = "mpi"))]
        pub fn gather_hosts(&self, mine: RankHost) -> Result<Vec<RankHost>, RunError> {
            Ok(vec![mine])
        }

        /// Trains as this rank. A failed rank aborts the whole MPI job (`MPI_Abort`, exit
        /// status 1 on every process) after printing its error, so no peer waits for it.
        pub fn train(
            &self,
            run: &PreparedRun,
            alloc: Option<&'static CountingAllocator>,
            hooks: &dyn TrainHooks,
            progress: &(dyn Fn(&StepReport) + Sync),
        ) -> crate::error::Result<TrainReport> {
            #[cfg(feature = "mpi")]
            {
                use fsdp_comm::{mpi::MpiComm, CommError, Communicator, Topology};
                let factory = |t: Topology| -> Result<Box<dyn Communicator>, CommError> {
                    let c = MpiComm::world(&self.universe, t, self.timeout)?;
                    Ok(Box::new(c))
                };
                let r = crate::train::train_prepared(run, alloc, hooks, progress, Some(&factory));
                if let Err(e) = &r {
                    crate::output::errln!(
                        "fsdp train: rank {}: {e}; aborting the MPI job",
                        self.rank
                    );
                    self.universe.abort(1);
                }
                r
            }
            #[cfg(not(feature = "mpi"))]
            {
                let _ = (run, alloc, hooks, progress);
                Err(crate::error::EngineError::Config(
                    "--backend mpi needs a binary built with --features mpi".into(),
                ))
            }
        }
    }
}
