//! The fixed binary encodings every multi-process backend sends between its ranks: a
//! collective's [`CallDesc`] (the descriptor of the call agreement, [`CALL_WORDS`] x u64, see
//! [`crate::agreement`]), a [`CommError`] (abort notices, a rank's failure), an exit notice (a
//! rank's call counts per group when it dropped its communicator) and a conformance rank's
//! result. The MPI and NCCL backends and their launchers use exactly these.
//!
//! Little-endian `u64` words and length-prefixed UTF-8 strings; no serde, so the encoding is
//! exactly what these functions write and the decoder rejects anything else (`None`).

use crate::conformance::RankResult;
use crate::error::{CallDesc, CommError, OpKind, RankCalls};
use crate::topology::{Group, ReduceOp};
use fsdp_types::DType;

/// Words of an encoded [`CallDesc`].
pub(crate) const CALL_WORDS: usize = 8;

/// An encoded [`CallDesc`]: the fixed-size descriptor ranks exchange before a collective.
pub(crate) type Descriptor = [u64; CALL_WORDS];

const NONE: u64 = u64::MAX;

fn op_code(op: OpKind) -> u64 {
    match op {
        OpKind::AllGather => 0,
        OpKind::ReduceScatter => 1,
        OpKind::AllReduce => 2,
        OpKind::Broadcast => 3,
        OpKind::Barrier => 4,
    }
}

fn op_from(c: u64) -> Option<OpKind> {
    Some(match c {
        0 => OpKind::AllGather,
        1 => OpKind::ReduceScatter,
        2 => OpKind::AllReduce,
        3 => OpKind::Broadcast,
        4 => OpKind::Barrier,
        _ => return None,
    })
}

/// The code of a group on the wire, also its index in per-group arrays (world 0, shard 1,
/// replicate 2).
pub(crate) fn group_code(g: Group) -> u64 {
    match g {
        Group::World => 0,
        Group::Shard => 1,
        Group::Replicate => 2,
    }
}

fn group_from(c: u64) -> Option<Group> {
    Some(match c {
        0 => Group::World,
        1 => Group::Shard,
        2 => Group::Replicate,
        _ => return None,
    })
}

fn reduce_code(r: Option<ReduceOp>) -> u64 {
    match r {
        None => NONE,
        Some(ReduceOp::Sum) => 0,
        Some(ReduceOp::Avg) => 1,
        Some(ReduceOp::Max) => 2,
    }
}

fn reduce_from(c: u64) -> Option<Option<ReduceOp>> {
    Some(match c {
        NONE => None,
        0 => Some(ReduceOp::Sum),
        1 => Some(ReduceOp::Avg),
        2 => Some(ReduceOp::Max),
        _ => return None,
    })
}

fn dtype_code(d: DType) -> u64 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F64 => 3,
    }
}

fn dtype_from(c: u64) -> Option<DType> {
    Some(match c {
        0 => DType::F32,
        1 => DType::BF16,
        2 => DType::F16,
        3 => DType::F64,
        _ => return None,
    })
}

/// Encodes a call as 8 words: op, group, reduction, dtype, send numel, recv numel, root, seq.
pub(crate) fn encode_call(c: &CallDesc) -> Descriptor {
    [
        op_code(c.op),
        group_code(c.group),
        reduce_code(c.reduce),
        c.dtype.map_or(NONE, dtype_code),
        c.send_numel as u64,
        c.recv_numel as u64,
        c.root.map_or(NONE, |r| r as u64),
        c.seq,
    ]
}

/// Decodes [`encode_call`]'s words; `None` for words it never writes.
pub(crate) fn decode_call(w: &Descriptor) -> Option<CallDesc> {
    Some(CallDesc {
        op: op_from(w[0])?,
        group: group_from(w[1])?,
        reduce: reduce_from(w[2])?,
        dtype: if w[3] == NONE {
            None
        } else {
            Some(dtype_from(w[3])?)
        },
        send_numel: usize::try_from(w[4]).ok()?,
        recv_numel: usize::try_from(w[5]).ok()?,
        root: if w[6] == NONE {
            None
        } else {
            Some(usize::try_from(w[6]).ok()?)
        },
        seq: w[7],
    })
}

/// Appends little-endian words and strings to a byte vector.
#[derive(Default)]
pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    /// Appends one word.
    pub(crate) fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    /// Appends a count or index as one word.
    pub(crate) fn usize(&mut self, x: usize) {
        self.u64(x as u64);
    }
    /// Appends a length-prefixed UTF-8 string.
    pub(crate) fn str(&mut self, s: &str) {
        self.usize(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    /// Appends an encoded call.
    pub(crate) fn call(&mut self, c: &CallDesc) {
        for w in encode_call(c) {
            self.u64(w);
        }
    }
}

/// Reads what [`Writer`] wrote; every read returns `None` past the end.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl Reader<'_> {
    /// Reads one word.
    pub(crate) fn u64(&mut self) -> Option<u64> {
        let (h, t) = self.0.split_first_chunk::<8>()?;
        self.0 = t;
        Some(u64::from_le_bytes(*h))
    }
    /// Reads a count or index.
    pub(crate) fn usize(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }
    /// Reads a length-prefixed UTF-8 string.
    pub(crate) fn string(&mut self) -> Option<String> {
        let n = self.usize()?;
        if n > self.0.len() {
            return None;
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        String::from_utf8(h.to_vec()).ok()
    }
    /// Reads an encoded call.
    pub(crate) fn call(&mut self) -> Option<CallDesc> {
        let mut w = [0u64; CALL_WORDS];
        for x in &mut w {
            *x = self.u64()?;
        }
        decode_call(&w)
    }
}

/// The `&'static str` fields of [`CommError`] come from a small fixed vocabulary; a decoded
/// string outside it is leaked once so the error can carry it (errors are rare and small).
fn static_str(s: String) -> &'static str {
    const KNOWN: &[&str] = &[
        "send",
        "recv",
        "input",
        "threads",
        "mpi",
        "nccl",
        "cuda",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "shard_size and replicate_size must both be at least 1",
        "world_size must equal shard_size x replicate_size",
    ];
    KNOWN
        .iter()
        .find(|k| **k == s)
        .copied()
        .unwrap_or_else(|| Box::leak(s.into_boxed_str()))
}

/// Encodes an error (every [`CommError`] variant) as bytes.
pub(crate) fn encode_error(e: &CommError, w: &mut Writer) {
    match e {
        CommError::InvalidTopology {
            world_size,
            shard_size,
            replicate_size,
            reason,
        } => {
            w.u64(0);
            w.usize(*world_size);
            w.usize(*shard_size);
            w.usize(*replicate_size);
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
            w.usize(*rank);
            w.u64(op_code(*op));
            w.u64(group_code(*group));
            w.usize(*group_size);
            w.str(what);
            w.usize(*expected);
            w.usize(*got);
        }
        CommError::DTypeMismatch {
            rank,
            op,
            send,
            recv,
        } => {
            w.u64(2);
            w.usize(*rank);
            w.u64(op_code(*op));
            w.u64(dtype_code(*send));
            w.u64(dtype_code(*recv));
        }
        CommError::InvalidRoot {
            rank,
            group,
            root,
            group_size,
        } => {
            w.u64(3);
            w.usize(*rank);
            w.u64(group_code(*group));
            w.usize(*root);
            w.usize(*group_size);
        }
        CommError::MismatchedCalls { calls } => {
            w.u64(4);
            w.usize(calls.0.len());
            for (r, c) in &calls.0 {
                w.usize(*r);
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
            w.usize(*rank);
            w.call(call);
            w.usize(*peer);
            w.u64(*peer_calls);
        }
        CommError::PeerFailed { peer, reason } => {
            w.u64(6);
            w.usize(*peer);
            w.str(reason);
        }
        CommError::Timeout {
            rank,
            call,
            waited_ms,
            missing,
        } => {
            w.u64(7);
            w.usize(*rank);
            w.call(call);
            w.u64(*waited_ms);
            w.usize(missing.len());
            for m in missing {
                w.usize(*m);
            }
        }
        CommError::RankPanicked { rank, message } => {
            w.u64(8);
            w.usize(*rank);
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
            w.usize(*rank);
            w.usize(*world_size);
            w.str(reason);
        }
        CommError::Device {
            rank,
            library,
            call,
            message,
        } => {
            w.u64(12);
            w.usize(*rank);
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
            w.usize(*rank);
            w.u64(op_code(*op));
            w.str(backend);
            w.u64(dtype_code(*dtype));
            w.usize(*numel);
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
            w.usize(*rank);
            w.u64(op_code(*op));
            w.str(dtype);
            w.usize(shape.len());
            for d in shape {
                w.usize(*d);
            }
            w.str(device);
            w.str(reason);
        }
    }
}

/// Decodes [`encode_error`]'s bytes; `None` for anything it never writes.
pub(crate) fn decode_error(r: &mut Reader<'_>) -> Option<CommError> {
    Some(match r.u64()? {
        0 => CommError::InvalidTopology {
            world_size: r.usize()?,
            shard_size: r.usize()?,
            replicate_size: r.usize()?,
            reason: static_str(r.string()?),
        },
        1 => CommError::SizeMismatch {
            rank: r.usize()?,
            op: op_from(r.u64()?)?,
            group: group_from(r.u64()?)?,
            group_size: r.usize()?,
            what: static_str(r.string()?),
            expected: r.usize()?,
            got: r.usize()?,
        },
        2 => CommError::DTypeMismatch {
            rank: r.usize()?,
            op: op_from(r.u64()?)?,
            send: dtype_from(r.u64()?)?,
            recv: dtype_from(r.u64()?)?,
        },
        3 => CommError::InvalidRoot {
            rank: r.usize()?,
            group: group_from(r.u64()?)?,
            root: r.usize()?,
            group_size: r.usize()?,
        },
        4 => {
            let n = r.usize()?;
            let mut calls = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                calls.push((r.usize()?, r.call()?));
            }
            CommError::MismatchedCalls {
                calls: RankCalls(calls),
            }
        }
        5 => CommError::PeerExited {
            rank: r.usize()?,
            call: r.call()?,
            peer: r.usize()?,
            peer_calls: r.u64()?,
        },
        6 => CommError::PeerFailed {
            peer: r.usize()?,
            reason: r.string()?,
        },
        7 => {
            let rank = r.usize()?;
            let call = r.call()?;
            let waited_ms = r.u64()?;
            let n = r.usize()?;
            let mut missing = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                missing.push(r.usize()?);
            }
            CommError::Timeout {
                rank,
                call,
                waited_ms,
                missing,
            }
        }
        8 => CommError::RankPanicked {
            rank: r.usize()?,
            message: r.string()?,
        },
        9 => CommError::Unsupported {
            backend: static_str(r.string()?),
            what: r.string()?,
        },
        10 => {
            let name = static_str(r.string()?);
            let set = r.u64()? != 0;
            let value = r.string()?;
            CommError::Env {
                name,
                value: set.then_some(value),
                reason: r.string()?,
            }
        }
        11 => CommError::Rendezvous {
            addr: r.string()?,
            rank: r.usize()?,
            world_size: r.usize()?,
            reason: r.string()?,
        },
        12 => CommError::Device {
            rank: r.usize()?,
            library: static_str(r.string()?),
            call: r.string()?,
            message: r.string()?,
        },
        13 => CommError::DeviceBufferUnreachable {
            rank: r.usize()?,
            op: op_from(r.u64()?)?,
            backend: static_str(r.string()?),
            dtype: dtype_from(r.u64()?)?,
            numel: r.usize()?,
            device: r.string()?,
        },
        14 => {
            let rank = r.usize()?;
            let op = op_from(r.u64()?)?;
            let dtype = r.string()?;
            let n = r.usize()?;
            let mut shape = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                shape.push(r.usize()?);
            }
            CommError::InvalidTensor {
                rank,
                op,
                dtype,
                shape,
                device: r.string()?,
                reason: r.string()?,
            }
        }
        _ => return None,
    })
}

/// Encodes an exit notice: the calls a rank made on each group (indexed by [`group_code`]).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn encode_exit(calls: [u64; 3]) -> Vec<u8> {
    let mut w = Writer::default();
    for c in calls {
        w.u64(c);
    }
    w.0
}

/// Decodes [`encode_exit`]'s bytes; `None` when fewer than three words arrived.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn decode_exit(b: &[u8]) -> Option<[u64; 3]> {
    let mut r = Reader(b);
    Some([r.u64()?, r.u64()?, r.u64()?])
}

/// Encodes one conformance rank's result: its values (as f64 bits) or its error.
pub(crate) fn encode_result(r: &RankResult) -> Vec<u8> {
    let mut w = Writer::default();
    match r {
        Ok(v) => {
            w.u64(0);
            w.usize(v.len());
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

/// Decodes [`encode_result`]'s bytes; `None` for an empty, truncated or otherwise undecodable
/// message (each launcher names the rank in its own error for that).
pub(crate) fn decode_result(b: &[u8]) -> Option<RankResult> {
    let mut r = Reader(b);
    match r.u64()? {
        0 => {
            let n = r.usize()?;
            let v = (0..n)
                .map(|_| r.u64().map(f64::from_bits))
                .collect::<Option<Vec<f64>>>()?;
            Some(Ok(v))
        }
        1 => Some(Err(decode_error(&mut r)?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(seq: u64) -> CallDesc {
        CallDesc {
            op: OpKind::ReduceScatter,
            group: Group::Replicate,
            reduce: Some(ReduceOp::Avg),
            dtype: Some(DType::BF16),
            send_numel: 12,
            recv_numel: 3,
            root: None,
            seq,
        }
    }

    #[test]
    fn calls_round_trip() {
        let c = call(7);
        assert_eq!(decode_call(&encode_call(&c)), Some(c));
        let b = CallDesc {
            op: OpKind::Broadcast,
            group: Group::World,
            reduce: None,
            dtype: Some(DType::F64),
            send_numel: 0,
            recv_numel: 0,
            root: Some(2),
            seq: 0,
        };
        assert_eq!(decode_call(&encode_call(&b)), Some(b));
        let mut bad = encode_call(&b);
        bad[0] = 9;
        assert_eq!(decode_call(&bad), None);
        let r = CallDesc {
            op: OpKind::ReduceScatter,
            group: Group::World,
            reduce: Some(ReduceOp::Avg),
            dtype: None,
            send_numel: 0,
            recv_numel: 0,
            root: None,
            seq: 0,
        };
        assert_eq!(decode_call(&encode_call(&r)), Some(r));
        let mut bad = encode_call(&r);
        bad[0] = 17;
        assert_eq!(decode_call(&bad), None);
    }

    #[test]
    fn exit_notices_round_trip() {
        assert_eq!(decode_exit(&encode_exit([3, 0, 7])), Some([3, 0, 7]));
        assert_eq!(decode_exit(&encode_exit([1, 2, 3])[..23]), None);
    }

    #[test]
    fn every_error_variant_round_trips() {
        let errors = vec![
            CommError::InvalidTopology {
                world_size: 5,
                shard_size: 2,
                replicate_size: 2,
                reason: "world_size must equal shard_size x replicate_size",
            },
            CommError::SizeMismatch {
                rank: 1,
                op: OpKind::AllGather,
                group: Group::Shard,
                group_size: 3,
                what: "recv",
                expected: 12,
                got: 11,
            },
            CommError::DTypeMismatch {
                rank: 2,
                op: OpKind::AllReduce,
                send: DType::F16,
                recv: DType::F32,
            },
            CommError::InvalidRoot {
                rank: 0,
                group: Group::World,
                root: 4,
                group_size: 3,
            },
            CommError::MismatchedCalls {
                calls: RankCalls(vec![(0, call(1)), (3, call(2))]),
            },
            CommError::PeerExited {
                rank: 2,
                call: call(4),
                peer: 1,
                peer_calls: 4,
            },
            CommError::PeerFailed {
                peer: 3,
                reason: "rank 3 fails on purpose".into(),
            },
            CommError::Timeout {
                rank: 0,
                call: call(0),
                waited_ms: 301,
                missing: vec![1, 5],
            },
            CommError::RankPanicked {
                rank: 3,
                message: "boom".into(),
            },
            CommError::Unsupported {
                backend: "mpi",
                what: "too big".into(),
            },
            CommError::Env {
                name: "RANK",
                value: Some("x".into()),
                reason: "not a number".into(),
            },
            CommError::Rendezvous {
                addr: "127.0.0.1:29500".into(),
                rank: 1,
                world_size: 2,
                reason: "rank 1 never arrived".into(),
            },
            CommError::DeviceBufferUnreachable {
                rank: 1,
                op: OpKind::ReduceScatter,
                backend: "mpi",
                dtype: DType::BF16,
                numel: 4096,
                device: "cuda:0".into(),
            },
            CommError::InvalidTensor {
                rank: 2,
                op: OpKind::AllGather,
                dtype: "u8".into(),
                shape: vec![2, 3],
                device: "cpu".into(),
                reason: "strided".into(),
            },
            CommError::Device {
                rank: 0,
                library: "nccl",
                call: "ncclAllGather".into(),
                message: "unhandled cuda error".into(),
            },
        ];
        for e in errors {
            let mut w = Writer::default();
            encode_error(&e, &mut w);
            let mut r = Reader(&w.0);
            assert_eq!(decode_error(&mut r).as_ref(), Some(&e));
            assert!(r.0.is_empty());
            // A truncated encoding is rejected, never misread.
            let mut short = Reader(&w.0[..w.0.len() - 1]);
            assert_eq!(decode_error(&mut short), None);
        }
    }

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
            assert_eq!(decode_result(&b).as_ref(), Some(&r));
            assert_eq!(decode_result(&b[..b.len() - 1]), None);
        }
        assert_eq!(decode_result(&[]), None);
    }
}
