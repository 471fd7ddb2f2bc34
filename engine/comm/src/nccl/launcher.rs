//! [`NcclLauncher`]: runs the conformance suite's per-rank bodies on NCCL communicators, either
//! one rank in this process (world size 1) or one rank per process of a job started by
//! `fsdp launch --nproc P` (torchrun's environment; the job's rendezvous carries each launch's
//! unique id and every rank's result).

use super::{NcclComm, NcclId, NcclOptions};
use crate::conformance::{Launcher, RankBody, RankResult};
use crate::error::{CallDesc, CommError, OpKind, RankCalls};
use crate::rendezvous::{LaunchEnv, Rendezvous};
use crate::topology::{Group, Topology};
use cudarc::driver::CudaContext;
use fsdp_types::DType;
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
                let bytes = mine.as_ref().map(encode_result).unwrap_or_default();
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

// ---------------------------------------------------------------- result codec

#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn call(&mut self, c: &CallDesc) {
        for x in super::encode_call(c) {
            self.u64(x);
        }
    }
    fn list(&mut self, v: &[usize]) {
        self.u64(v.len() as u64);
        for &x in v {
            self.u64(x as u64);
        }
    }
}

struct R<'a>(&'a [u8]);

impl R<'_> {
    fn u64(&mut self) -> Option<u64> {
        let (h, t) = self.0.split_first_chunk::<8>()?;
        self.0 = t;
        Some(u64::from_le_bytes(*h))
    }
    fn us(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }
    fn string(&mut self) -> Option<String> {
        let n = self.us()?;
        if n > self.0.len() {
            return None;
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        String::from_utf8(h.to_vec()).ok()
    }
    fn stat(&mut self) -> Option<&'static str> {
        // Error fields typed &'static str come from a small vocabulary; leak the rare decode.
        Some(Box::leak(self.string()?.into_boxed_str()))
    }
    fn call(&mut self) -> Option<CallDesc> {
        let mut w = [0u64; super::WORDS];
        for x in &mut w {
            *x = self.u64()?;
        }
        super::decode_call(&w)
    }
    fn list(&mut self) -> Option<Vec<usize>> {
        let n = self.us()?;
        (0..n.min(1 << 20)).map(|_| self.us()).collect()
    }
}

fn op_index(op: OpKind) -> u64 {
    match op {
        OpKind::AllGather => 0,
        OpKind::ReduceScatter => 1,
        OpKind::AllReduce => 2,
        OpKind::Broadcast => 3,
        OpKind::Barrier => 4,
    }
}

fn op_of(x: u64) -> Option<OpKind> {
    [
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::Barrier,
    ]
    .get(x as usize)
    .copied()
}

fn dtype_index(d: DType) -> u64 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F64 => 3,
    }
}

fn dtype_of(x: u64) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16, DType::F64]
        .get(x as usize)
        .copied()
}

fn group_of(x: u64) -> Option<Group> {
    [Group::World, Group::Shard, Group::Replicate]
        .get(x as usize)
        .copied()
}

/// Encodes one rank's result (values as f64 bits, or any [`CommError`]).
pub(crate) fn encode_result(r: &RankResult) -> Vec<u8> {
    let mut w = W::default();
    match r {
        Ok(v) => {
            w.u64(0);
            w.u64(v.len() as u64);
            for x in v {
                w.u64(x.to_bits());
            }
        }
        Err(e) => {
            w.u64(1);
            encode_error(e, &mut w);
        }
    }
    w.0
}

fn encode_error(e: &CommError, w: &mut W) {
    match e {
        CommError::InvalidTopology {
            world_size,
            shard_size,
            replicate_size,
            reason,
        } => {
            w.u64(0);
            w.list(&[*world_size, *shard_size, *replicate_size]);
            w.str(reason);
        }
        CommError::SizeMismatch {
            rank,
            op,
            group,
            group_size,
            what,
            expected,
            got,
        } => {
            w.u64(1);
            w.list(&[*rank, *group_size, *expected, *got]);
            w.u64(op_index(*op));
            w.u64(super::group_index(*group) as u64);
            w.str(what);
        }
        CommError::DTypeMismatch {
            rank,
            op,
            send,
            recv,
        } => {
            w.u64(2);
            w.list(&[*rank]);
            w.u64(op_index(*op));
            w.u64(dtype_index(*send));
            w.u64(dtype_index(*recv));
        }
        CommError::InvalidRoot {
            rank,
            group,
            root,
            group_size,
        } => {
            w.u64(3);
            w.list(&[*rank, *root, *group_size]);
            w.u64(super::group_index(*group) as u64);
        }
        CommError::MismatchedCalls { calls } => {
            w.u64(4);
            w.u64(calls.0.len() as u64);
            for (r, c) in &calls.0 {
                w.u64(*r as u64);
                w.call(c);
            }
        }
        CommError::PeerExited {
            rank,
            call,
            peer,
            peer_calls,
        } => {
            w.u64(5);
            w.list(&[*rank, *peer]);
            w.u64(*peer_calls);
            w.call(call);
        }
        CommError::PeerFailed { peer, reason } => {
            w.u64(6);
            w.u64(*peer as u64);
            w.str(reason);
        }
        CommError::Timeout {
            rank,
            call,
            waited_ms,
            missing,
        } => {
            w.u64(7);
            w.u64(*rank as u64);
            w.call(call);
            w.u64(*waited_ms);
            w.list(missing);
        }
        CommError::RankPanicked { rank, message } => {
            w.u64(8);
            w.u64(*rank as u64);
            w.str(message);
        }
        CommError::Unsupported { backend, what } => {
            w.u64(9);
            w.str(backend);
            w.str(what);
        }
        CommError::Env {
            name,
            value,
            reason,
        } => {
            w.u64(10);
            w.str(name);
            w.u64(u64::from(value.is_some()));
            w.str(value.as_deref().unwrap_or(""));
            w.str(reason);
        }
        CommError::Rendezvous {
            addr,
            rank,
            world_size,
            reason,
        } => {
            w.u64(11);
            w.str(addr);
            w.list(&[*rank, *world_size]);
            w.str(reason);
        }
        CommError::Device {
            rank,
            library,
            call,
            message,
        } => {
            w.u64(12);
            w.u64(*rank as u64);
            w.str(library);
            w.str(call);
            w.str(message);
        }
        CommError::DeviceBufferUnreachable {
            rank,
            op,
            backend,
            dtype,
            numel,
            device,
        } => {
            w.u64(13);
            w.list(&[*rank, *numel]);
            w.u64(op_index(*op));
            w.str(backend);
            w.u64(dtype_index(*dtype));
            w.str(device);
        }
        CommError::InvalidTensor {
            rank,
            op,
            dtype,
            shape,
            device,
            reason,
        } => {
            w.u64(14);
            w.u64(*rank as u64);
            w.u64(op_index(*op));
            w.str(dtype);
            w.list(shape);
            w.str(device);
            w.str(reason);
        }
    }
}

fn decode_error(r: &mut R<'_>) -> Option<CommError> {
    Some(match r.u64()? {
        0 => {
            let v = r.list()?;
            CommError::InvalidTopology {
                world_size: *v.first()?,
                shard_size: *v.get(1)?,
                replicate_size: *v.get(2)?,
                reason: r.stat()?,
            }
        }
        1 => {
            let v = r.list()?;
            CommError::SizeMismatch {
                rank: *v.first()?,
                group_size: *v.get(1)?,
                expected: *v.get(2)?,
                got: *v.get(3)?,
                op: op_of(r.u64()?)?,
                group: group_of(r.u64()?)?,
                what: r.stat()?,
            }
        }
        2 => {
            let v = r.list()?;
            CommError::DTypeMismatch {
                rank: *v.first()?,
                op: op_of(r.u64()?)?,
                send: dtype_of(r.u64()?)?,
                recv: dtype_of(r.u64()?)?,
            }
        }
        3 => {
            let v = r.list()?;
            CommError::InvalidRoot {
                rank: *v.first()?,
                root: *v.get(1)?,
                group_size: *v.get(2)?,
                group: group_of(r.u64()?)?,
            }
        }
        4 => {
            let n = r.us()?;
            let mut calls = Vec::new();
            for _ in 0..n.min(1 << 16) {
                calls.push((r.us()?, r.call()?));
            }
            CommError::MismatchedCalls {
                calls: RankCalls(calls),
            }
        }
        5 => {
            let v = r.list()?;
            CommError::PeerExited {
                rank: *v.first()?,
                peer: *v.get(1)?,
                peer_calls: r.u64()?,
                call: r.call()?,
            }
        }
        6 => CommError::PeerFailed {
            peer: r.us()?,
            reason: r.string()?,
        },
        7 => CommError::Timeout {
            rank: r.us()?,
            call: r.call()?,
            waited_ms: r.u64()?,
            missing: r.list()?,
        },
        8 => CommError::RankPanicked {
            rank: r.us()?,
            message: r.string()?,
        },
        9 => CommError::Unsupported {
            backend: r.stat()?,
            what: r.string()?,
        },
        10 => {
            let name = r.stat()?;
            let set = r.u64()? != 0;
            let value = r.string()?;
            CommError::Env {
                name,
                value: set.then_some(value),
                reason: r.string()?,
            }
        }
        11 => {
            let addr = r.string()?;
            let v = r.list()?;
            CommError::Rendezvous {
                addr,
                rank: *v.first()?,
                world_size: *v.get(1)?,
                reason: r.string()?,
            }
        }
        12 => CommError::Device {
            rank: r.us()?,
            library: r.stat()?,
            call: r.string()?,
            message: r.string()?,
        },
        13 => {
            let v = r.list()?;
            CommError::DeviceBufferUnreachable {
                rank: *v.first()?,
                numel: *v.get(1)?,
                op: op_of(r.u64()?)?,
                backend: r.stat()?,
                dtype: dtype_of(r.u64()?)?,
                device: r.string()?,
            }
        }
        14 => CommError::InvalidTensor {
            rank: r.us()?,
            op: op_of(r.u64()?)?,
            dtype: r.string()?,
            shape: r.list()?,
            device: r.string()?,
            reason: r.string()?,
        },
        _ => return None,
    })
}

/// Decodes [`encode_result`]'s bytes of rank `rank` (an empty or undecodable message is an
/// error naming the rank).
pub(crate) fn decode_result(rank: usize, b: &[u8]) -> RankResult {
    let bad = || CommError::PeerFailed {
        peer: rank,
        reason: format!("rank {rank}'s result ({} bytes) cannot be decoded", b.len()),
    };
    let mut r = R(b);
    match r.u64() {
        Some(0) => {
            let n = r.us().ok_or_else(bad)?;
            (0..n)
                .map(|_| r.u64().map(f64::from_bits).ok_or_else(bad))
                .collect()
        }
        Some(1) => Err(decode_error(&mut r).ok_or_else(bad)?),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::ReduceOp;

    #[test]
    fn every_result_round_trips() {
        let call = CallDesc {
            op: OpKind::AllReduce,
            group: Group::Shard,
            reduce: Some(ReduceOp::Max),
            dtype: Some(DType::F16),
            send_numel: 9,
            recv_numel: 9,
            root: None,
            seq: 3,
        };
        let results: Vec<RankResult> = vec![
            Ok(vec![1.5, -0.0, f64::INFINITY]),
            Ok(vec![]),
            Err(CommError::InvalidTopology {
                world_size: 5,
                shard_size: 2,
                replicate_size: 2,
                reason: "world_size must equal shard_size x replicate_size",
            }),
            Err(CommError::SizeMismatch {
                rank: 1,
                op: OpKind::AllGather,
                group: Group::World,
                group_size: 3,
                what: "recv",
                expected: 12,
                got: 11,
            }),
            Err(CommError::DTypeMismatch {
                rank: 2,
                op: OpKind::AllGather,
                send: DType::BF16,
                recv: DType::F32,
            }),
            Err(CommError::InvalidRoot {
                rank: 0,
                group: Group::Replicate,
                root: 3,
                group_size: 3,
            }),
            Err(CommError::MismatchedCalls {
                calls: RankCalls(vec![(0, call), (1, call)]),
            }),
            Err(CommError::PeerExited {
                rank: 0,
                call,
                peer: 1,
                peer_calls: 7,
            }),
            Err(CommError::PeerFailed {
                peer: 3,
                reason: "x".into(),
            }),
            Err(CommError::Timeout {
                rank: 0,
                call,
                waited_ms: 300,
                missing: vec![1],
            }),
            Err(CommError::RankPanicked {
                rank: 3,
                message: "on purpose".into(),
            }),
            Err(CommError::DeviceBufferUnreachable {
                rank: 1,
                op: OpKind::Broadcast,
                backend: "threads",
                dtype: DType::F64,
                numel: 77,
                device: "cuda:1".into(),
            }),
            Err(CommError::InvalidTensor {
                rank: 0,
                op: OpKind::AllReduce,
                dtype: "f32".into(),
                shape: vec![4, 5, 6],
                device: "cuda:0".into(),
                reason: "on cuda:0 but the communicator runs on cuda:1".into(),
            }),
            Err(CommError::Unsupported {
                backend: "nccl",
                what: "w".into(),
            }),
            Err(CommError::Env {
                name: "RANK",
                value: None,
                reason: "not set".into(),
            }),
            Err(CommError::Rendezvous {
                addr: "127.0.0.1:1".into(),
                rank: 1,
                world_size: 2,
                reason: "r".into(),
            }),
            Err(CommError::Device {
                rank: 0,
                library: "nccl",
                call: "ncclAllGather".into(),
                message: "m".into(),
            }),
        ];
        for r in results {
            let b = encode_result(&r);
            assert_eq!(decode_result(0, &b), r);
            assert!(decode_result(0, &b[..b.len() - 1]).is_err());
        }
        assert!(matches!(
            decode_result(4, &[]),
            Err(CommError::PeerFailed { peer: 4, .. })
        ));
    }
}
