//! The memory pre-flight of a run, before any rank starts: the thread backend's cap on rank
//! threads, the check that the plan's peak per rank (plus the token ids and a margin) fits
//! the memory of the ranks' hosts, the default budget of `Strategy::Auto` on host memory
//! (which the plan stage, [`crate::strategy`], resolves `Auto` against), and the compute
//! threads per rank. Every check here is a pure function of its inputs (the host
//! table, the plan), so every rank of a job takes the same decision and refuses together.

use crate::error::RunError;
use crate::options::{model_of, plan_config, TrainOptions};
use crate::strategy::plan_for;
use fsdp_planner::Strategy;

/// The budget types of the plan stage, which [`auto_budget`] and [`resolve_strategy`] take
/// and return.
pub use crate::strategy::{AutoResolution, Budget};

/// Most rank threads the in-process (`--backend threads`) backend starts: each rank is an OS
/// thread with its own compute pool and stack, so tens of thousands of them exhaust the
/// process's address space or thread limit long before the memory check below can help.
/// Larger worlds need `--backend mpi`.
pub const MAX_THREAD_WORLD_SIZE: usize = 1024;

/// Safety margin of the pre-flight memory check, in percent of the plan: the plan counts
/// engine-owned bytes and activations exactly (the measured process peak is 0.92-0.97 of it),
/// the margin covers allocator slack, the data set and candle's short-lived temporaries.
pub const MEMORY_MARGIN_PERCENT: u64 = 25;

/// Bytes the kernel says a new allocation can still get (`MemAvailable` in `/proc/meminfo`),
/// or `None` where that file is missing or unreadable (non-Linux): the pre-flight memory check
/// is then skipped.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|l| {
        let kib = l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?;
        kib.trim().parse::<u64>().ok()?.checked_mul(1024)
    })
}

/// Refuses more rank threads than [`MAX_THREAD_WORLD_SIZE`] on the thread backend, before
/// anything is planned.
///
/// Errors: [`RunError::Refused`] naming the limit and `--backend mpi`.
pub fn check_thread_world_size(w: usize) -> Result<(), RunError> {
    if w > MAX_THREAD_WORLD_SIZE {
        return Err(RunError::Refused(format!(
            "--world-size {w} exceeds the thread backend's limit of {MAX_THREAD_WORLD_SIZE} rank \
             threads in one process; use a smaller --world-size or --backend mpi"
        )));
    }
    Ok(())
}

/// The thread backend's pre-flight check, before any rank starts: all `W` rank threads share
/// this process, so `W x` the plan's per-rank peak `plan_peak` (engine-owned bytes plus
/// activations of one micro-batch) plus the step's token ids (`grad_accum x B x T x 8`
/// bytes), plus [`MEMORY_MARGIN_PERCENT`], must fit in `available` bytes (skipped when
/// `None`). Also caps `W` at [`MAX_THREAD_WORLD_SIZE`]. All arithmetic saturates, so huge
/// `--micro-batch` / `--seq-len` values give a message, never an overflow.
///
/// Errors: [`RunError::Refused`] giving the numbers and the flags to lower.
pub fn preflight_threads(
    opts: &TrainOptions,
    plan_peak: u64,
    available: Option<u64>,
) -> Result<(), RunError> {
    let w = opts.world_size;
    check_thread_world_size(w)?;
    let Some(available) = available else {
        return Ok(());
    };
    let per_rank = plan_peak.saturating_add(token_id_bytes(opts));
    let total = per_rank.saturating_mul(w as u64);
    let needed = with_margin(total);
    if needed > available {
        let staging = if opts.ckpt_async {
            " + the --ckpt-async staging copy of the shards"
        } else {
            ""
        };
        let drop_async = if opts.ckpt_async {
            ", or save checkpoints synchronously (without --ckpt-async)"
        } else {
            ""
        };
        return Err(RunError::Refused(format!(
            "not enough memory: {w} rank thread(s) x peak {} per rank (plan{staging} + token ids; --micro-batch {}, \
             --seq-len {}, --grad-accum {}) = {} + {MEMORY_MARGIN_PERCENT}% margin = {} > {} \
             available (MemAvailable); use a smaller --world-size, --micro-batch, --seq-len or \
             --grad-accum{drop_async}",
            mib(per_rank),
            opts.micro_batch,
            opts.seq_len,
            opts.grad_accum,
            mib(total),
            mib(needed),
            mib(available)
        )));
    }
    Ok(())
}

/// The host side of a run beside a GPU (offload, `--ckpt-async` staging): `local_ranks` ranks of this node each keep
/// `host_bytes` (the plan's [`fsdp_planner::MemoryPlan::host_peak`]: master, gradient and
/// optimizer-state shards and the staging buffers) in this host's memory, which must hold
/// them with the margin. `available`: this host's `MemAvailable` (`None`: unknown, no check).
///
/// Errors: [`RunError::Refused`] with the numbers when they do not fit.
pub fn preflight_offload_host(
    opts: &TrainOptions,
    host_bytes: u64,
    available: Option<u64>,
    local_ranks: u64,
) -> Result<(), RunError> {
    let Some(available) = available else {
        return Ok(());
    };
    let total = host_bytes.saturating_mul(local_ranks.max(1));
    let needed = with_margin(total);
    if needed > available {
        let what = match (opts.offload.filter(|o| o.is_some()), opts.ckpt_async) {
            (Some(o), false) => format!("--offload {o}"),
            (Some(o), true) => format!("--offload {o} and the --ckpt-async staging"),
            (None, _) => "the --ckpt-async staging".to_string(),
        };
        return Err(RunError::Refused(format!(
            "not enough host memory for {what}: {} rank(s) on this node x {} of offloaded \
             state per rank = {} + {MEMORY_MARGIN_PERCENT}% margin = {} > {} available \
             (MemAvailable); use more nodes, --offload optimizer instead of params, a smaller \
             model, or synchronous checkpoints",
            local_ranks.max(1),
            mib(host_bytes),
            mib(total),
            mib(needed),
            mib(available)
        )));
    }
    Ok(())
}

/// The plan's peak bytes per rank for `opts` (a resolved strategy, not `Auto`), planned on its
/// own: a run reads its peak from the plan [`crate::run::prepare`] made.
///
/// Errors: [`RunError::Refused`] for an unknown model or options the planner refuses.
pub fn plan_peak(opts: &TrainOptions) -> Result<u64, RunError> {
    let model = model_of(opts)?;
    let plan = fsdp_planner::plan(
        crate::runtime::StagedModel::spec(&model),
        &plan_config(opts),
    )?;
    Ok(plan.memory.peak.0)
}

/// Bytes of token ids a rank holds during a step, which the plan does not count: all
/// `--grad-accum` micro-batches at once, input and target, u32 (8 bytes per token). Saturates.
pub fn token_id_bytes(opts: &TrainOptions) -> u64 {
    (opts.grad_accum as u64)
        .saturating_mul(opts.micro_batch as u64)
        .saturating_mul(opts.seq_len as u64)
        .saturating_mul(8)
}

/// `total` plus [`MEMORY_MARGIN_PERCENT`] of it (of `total / 100`, rounded down), saturating:
/// what the pre-flight checks need available.
pub fn with_margin(total: u64) -> u64 {
    total.saturating_add(total / 100 * MEMORY_MARGIN_PERCENT)
}

/// The per-rank memory budget of a host share: `available` bytes shared by `ranks` ranks,
/// less the pre-flight's [`MEMORY_MARGIN_PERCENT`] margin and the token ids
/// (`ids_per_rank`, [`token_id_bytes`]) each rank holds besides its plan:
/// `floor(floor(available / ranks) x 100 / (100 + margin)) - ids_per_rank` (0 when the ids
/// alone do not fit). A plan whose peak is at most this budget passes the pre-flight check
/// ([`preflight_threads`], [`preflight_mpi`]) for the same `available` and `ranks`:
/// `ranks x (budget + ids) x (1 + margin) <= available`. `ranks` 0 counts as 1.
pub fn host_budget_per_rank(available: u64, ranks: u64, ids_per_rank: u64) -> u64 {
    let share = available / ranks.max(1);
    let budget = (share as u128 * 100 / (100 + MEMORY_MARGIN_PERCENT) as u128) as u64;
    budget.saturating_sub(ids_per_rank)
}

/// What one MPI process read about its node before training, gathered from every rank so
/// that every rank takes the same pre-flight decision on the same numbers
/// ([`preflight_mpi`], [`mpi_auto_budget`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankHost {
    /// Bytes the kernel says new allocations can get on the rank's node
    /// ([`available_memory`]); `None` where unreadable.
    pub available: Option<u64>,
    /// The rank's node: a 53-bit FNV-1a hash of its host name (ranks with equal values share a
    /// node); `None` where the host name is unreadable.
    pub node: Option<u64>,
    /// Ranks on the node as the launcher says (`OMPI_COMM_WORLD_LOCAL_SIZE` of Open MPI,
    /// `MPI_LOCALNRANKS` of MPICH's Hydra); `None` when neither is set.
    pub launcher_local_ranks: Option<u64>,
}

impl RankHost {
    /// This process's view: [`available_memory`], the host name
    /// (`/proc/sys/kernel/hostname`, else `$HOSTNAME`) and the launcher's local size.
    pub fn this_process() -> RankHost {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()));
        RankHost {
            available: available_memory(),
            node: host.map(|h| node_id(&h)),
            launcher_local_ranks: launcher_local_ranks(|k| std::env::var(k).ok()),
        }
    }

    /// The three values as f64 (exact: all below 2^53; `None` as -1), one row of the table
    /// the ranks all-reduce (sum over rows that are zero except the rank's own).
    pub fn encode(&self) -> [f64; 3] {
        let f = |v: Option<u64>| v.map_or(-1.0, |x| x.min(MAX_EXACT) as f64);
        [
            f(self.available),
            f(self.node),
            f(self.launcher_local_ranks),
        ]
    }

    /// The inverse of [`RankHost::encode`] (negative values and NaN are `None`).
    pub fn decode(row: [f64; 3]) -> RankHost {
        let f = |v: f64| (v >= 0.0).then_some(v as u64);
        RankHost {
            available: f(row[0]),
            node: f(row[1]),
            launcher_local_ranks: f(row[2]),
        }
    }
}

/// Largest integer every f64 holds exactly below it (2^53 - 1).
const MAX_EXACT: u64 = (1 << 53) - 1;

/// The 53-bit FNV-1a hash of a host name (Fowler, Noll, Vo; 64-bit offset basis and prime),
/// equal in every process for the same name.
pub fn node_id(host: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in host.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h & MAX_EXACT
}

/// Ranks on this node as the MPI launcher reports it through `env` (a variable lookup):
/// `OMPI_COMM_WORLD_LOCAL_SIZE` (Open MPI), then `MPI_LOCALNRANKS` (MPICH / Intel MPI Hydra);
/// `None` when neither holds a positive integer.
pub fn launcher_local_ranks(env: impl Fn(&str) -> Option<String>) -> Option<u64> {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|k| env(k)?.trim().parse::<u64>().ok().filter(|&n| n > 0))
}

/// Ranks sharing rank `r`'s node: the launcher's count when it gives one, else the ranks
/// whose host-name hash equals `r`'s; `None` when neither is known.
pub fn local_ranks(hosts: &[RankHost], r: usize) -> Option<u64> {
    let me = hosts.get(r)?;
    me.launcher_local_ranks.or_else(|| {
        me.node
            .map(|n| hosts.iter().filter(|h| h.node == Some(n)).count() as u64)
    })
}

/// The MPI backend's pre-flight check, the counterpart of [`preflight_threads`]: for every
/// rank `r` of `hosts` (one entry per rank, in rank order, the same table on every rank),
/// the ranks on `r`'s node ([`local_ranks`]) x (`plan_peak` + [`token_id_bytes`]) plus
/// [`MEMORY_MARGIN_PERCENT`] must fit in what `r` read as available. A rank whose numbers are
/// unknown is not checked. Every rank evaluates the same table, so every rank takes the same
/// decision and refuses with the same message (naming the first short rank) before training:
/// no rank is left waiting for a peer that quit.
///
/// Errors: [`RunError::Refused`] with the node's numbers and the flags to lower.
pub fn preflight_mpi(
    opts: &TrainOptions,
    plan_peak: u64,
    hosts: &[RankHost],
) -> Result<(), RunError> {
    let per_rank = plan_peak.saturating_add(token_id_bytes(opts));
    let short: Vec<(usize, u64, u64, u64, u64)> = (0..hosts.len())
        .filter_map(|r| {
            let available = hosts[r].available?;
            let local = local_ranks(hosts, r)?;
            let total = per_rank.saturating_mul(local);
            let needed = with_margin(total);
            (needed > available).then_some((r, local, total, needed, available))
        })
        .collect();
    let Some(&(r, local, total, needed, available)) = short.first() else {
        return Ok(());
    };
    Err(RunError::Refused(format!(
        "not enough memory on the node of MPI rank {r} ({} of {} ranks are short): {local} \
         rank(s) on the node x peak {} per rank (plan {} + token ids; --micro-batch {}, \
         --seq-len {}, --grad-accum {}) = {} + {MEMORY_MARGIN_PERCENT}% margin = {} > {} \
         available (MemAvailable); use a smaller --micro-batch, --seq-len or --grad-accum, \
         fewer ranks per node, or --strategy auto",
        short.len(),
        hosts.len(),
        mib(per_rank),
        mib(plan_peak),
        opts.micro_batch,
        opts.seq_len,
        opts.grad_accum,
        mib(total),
        mib(needed),
        mib(available)
    )))
}

/// `--strategy auto`'s default budget under `--backend mpi`: the smallest
/// [`host_budget_per_rank`] over the ranks of `hosts` (each rank's available memory shared by
/// the ranks on its node), with a description of where it comes from; `None` when any
/// rank's available memory or node is unknown. The same on every rank (the same table).
pub fn mpi_auto_budget(opts: &TrainOptions, hosts: &[RankHost]) -> Option<(u64, String)> {
    let ids = token_id_bytes(opts);
    let mut best: Option<(u64, String)> = None;
    for (r, h) in hosts.iter().enumerate() {
        let available = h.available?;
        let local = local_ranks(hosts, r)?;
        let b = host_budget_per_rank(available, local, ids);
        if best.as_ref().is_none_or(|(x, _)| b < *x) {
            best = Some((
                b,
                format!(
                    "the smallest share of the MPI ranks' nodes: MemAvailable {} on rank {r}'s node \
                     / {local} rank(s) there, less the {MEMORY_MARGIN_PERCENT}% margin and {} of \
                     token ids",
                    fsdp_types::Bytes(available),
                    fsdp_types::Bytes(ids)
                ),
            ));
        }
    }
    best
}

/// `--strategy auto`'s default budget on the thread backend: [`host_budget_per_rank`] of
/// `available` bytes over the `--world-size` rank threads of this process, with its
/// description; `None` without `available`.
pub fn threads_auto_budget(opts: &TrainOptions, available: Option<u64>) -> Option<(u64, String)> {
    let available = available?;
    let ids = token_id_bytes(opts);
    let w = opts.world_size as u64;
    Some((
        host_budget_per_rank(available, w, ids),
        format!(
            "MemAvailable {} / {w} rank thread(s), less the {MEMORY_MARGIN_PERCENT}% margin and \
             {} of token ids",
            fsdp_types::Bytes(available),
            fsdp_types::Bytes(ids)
        ),
    ))
}

/// What the ranks of a run can see of their memory, for the pre-flight check and the default
/// budget of `Strategy::Auto`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankMemory {
    /// Rank threads of this process on host memory: the bytes new allocations can get
    /// ([`available_memory`]; `None` where unknown, and the check is skipped).
    Threads {
        /// `MemAvailable` of this host.
        available: Option<u64>,
    },
    /// MPI processes on host memory: every rank's [`RankHost`], in rank order, the same table
    /// on every rank (`None`: not gathered, no check).
    Mpi {
        /// The gathered table.
        hosts: Option<Vec<RankHost>>,
    },
    /// A device (CUDA, NCCL processes): no host check and no default budget (the device is
    /// not queried; `--device-memory` gives the budget).
    Device,
}

/// The budget `Strategy::Auto` fits, with where it comes from: `budget` when given; else on
/// host memory the host share of `ranks` ([`threads_auto_budget`], [`mpi_auto_budget`]).
///
/// Errors: [`RunError::Refused`] on a device (or `opts` placed on CUDA) without a budget, and
/// where the host share is unknown.
pub fn auto_budget(
    opts: &TrainOptions,
    budget: Option<&Budget>,
    ranks: &RankMemory,
) -> Result<(u64, String), RunError> {
    if let Some(b) = budget {
        return Ok((b.bytes, format!("--device-memory {}", b.given)));
    }
    let found = match ranks {
        _ if opts.placement.device().is_cuda() => None,
        RankMemory::Device => None,
        RankMemory::Threads { available } => Some(threads_auto_budget(opts, *available)),
        RankMemory::Mpi { hosts } => Some(hosts.as_deref().and_then(|h| mpi_auto_budget(opts, h))),
    };
    let Some(found) = found else {
        return Err(RunError::Refused(
            "--strategy auto on a GPU needs --device-memory BYTES (the memory of one GPU, \
             e.g. 80GiB): fsdp train does not query the device"
                .into(),
        ));
    };
    found.ok_or_else(|| {
        RunError::Refused(
            "--strategy auto: this host's available memory per rank is unknown (no \
             /proc/meminfo, or the ranks' nodes cannot be told apart); give the budget \
             with --device-memory BYTES"
                .into(),
        )
    })
}

/// Resolves `Strategy::Auto` in `opts` on its own (sets `strategy` and
/// `activation_checkpointing` to the choice) for the budget [`auto_budget`] finds, or checks
/// an explicit strategy's plan peak against `budget`; [`crate::run::prepare`] does the same
/// on the run's one plan. `opts.world_size` must be the run's (after MPI init).
///
/// Returns `Some` for auto, `None` for an explicit strategy.
///
/// Errors: as [`auto_budget`] and [`plan_for`]; an unknown model.
pub fn resolve_strategy(
    opts: &mut TrainOptions,
    budget: Option<&Budget>,
    ranks: &RankMemory,
) -> Result<Option<AutoResolution>, RunError> {
    let auto = if opts.strategy == Strategy::Auto {
        Some(auto_budget(opts, budget, ranks)?)
    } else if budget.is_none() {
        return Ok(None);
    } else {
        None
    };
    let model = model_of(opts)?;
    plan_for(&model, opts, budget, auto).map(|(_, a)| a)
}

/// The compute threads per rank for `ranks` ranks on this node of `cores` cores, and a
/// warning when `requested` (`--threads-per-rank`) had to be lowered: more threads than cores
/// make every rank's pool spin and wait for cores the others hold (64 threads at W = 2 on 2
/// cores ran a step 9x slower than 1 thread). The cap is `max(1, cores / ranks)`, the
/// default's value. `None` requested is the default (no warning).
pub fn cap_threads(
    requested: Option<usize>,
    ranks: usize,
    cores: usize,
) -> (Option<usize>, Option<String>) {
    let fair = (cores / ranks.max(1)).max(1);
    match requested {
        Some(t) if t.saturating_mul(ranks.max(1)) > cores.max(1) && t > fair => (
            Some(fair),
            Some(format!(
                "warning: --threads-per-rank {t} x {ranks} rank(s) = {} compute threads on {cores} \
                 core(s) would oversubscribe them (each rank's pool spins waiting for cores); \
                 using {fair} per rank (at most cores / ranks)",
                fsdp_types::group_thousands(t.saturating_mul(ranks) as u64)
            )),
        ),
        other => (other, None),
    }
}

/// Threads of candle's process-wide element-wise pool (`CANDLE_NUM_THREADS`, the calling
/// thread included) beside `ranks` rank pools of `threads_per_rank` compute threads on
/// `cores` cores: the cores those pools leave free, plus the calling thread, so 1 when they
/// fill the cores. The pool's workers spin between element-wise ops; on cores the compute
/// threads use they take cycles from the GEMMs.
pub fn elementwise_threads(ranks: usize, threads_per_rank: usize, cores: usize) -> usize {
    cores.saturating_sub(ranks.max(1).saturating_mul(threads_per_rank)) + 1
}

/// CPU cores this process may run on (`available_parallelism`, 1 where unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_pool_gets_the_cores_the_ranks_leave_free() {
        assert_eq!(elementwise_threads(1, 2, 2), 1);
        assert_eq!(elementwise_threads(2, 1, 2), 1);
        assert_eq!(elementwise_threads(1, 1, 2), 2);
        assert_eq!(elementwise_threads(2, 2, 8), 5);
        assert_eq!(elementwise_threads(4, 1, 2), 1);
    }

    #[test]
    fn threads_are_capped_at_cores_over_ranks() {
        assert_eq!(cap_threads(Some(1000), 2, 2).0, Some(1));
        assert!(cap_threads(Some(1000), 2, 2).1.unwrap().contains("2,000"));
        assert_eq!(cap_threads(Some(4), 2, 8), (Some(4), None));
        assert_eq!(cap_threads(None, 2, 2), (None, None));
        // One thread per rank is never lowered, even with more ranks than cores.
        assert_eq!(cap_threads(Some(1), 4, 2), (Some(1), None));
    }
}
