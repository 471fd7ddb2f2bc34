//! The call agreement of the multi-process backends (MPI, NCCL): before any data moves, the
//! members of a group check that they all make the same collective call.
//!
//! # How a rank learns that another rank called a different collective
//! Every rank numbers its calls per group (`seq`, [`CallDesc::seq`]) and describes each call
//! completely: collective, group, reduction, dtype, element counts, root, call number. Before
//! the data phase, every member of the group sends this description, encoded as a fixed-size
//! [`Descriptor`] ([`codec::encode_call`], 8 x u64), to every other member and receives theirs
//! ([`Transport::exchange`]). Each member then compares all the descriptors ([`agree`]). Every
//! member holds the same list, so when any two differ every member returns the same
//! [`CommError::MismatchedCalls`] naming each rank's call, and nobody moves a byte. A rank
//! never reads a peer's buffer on the strength of a call it has not seen.
//!
//! A peer that never sends its descriptor is not waited for forever; the transport ends the
//! wait with an error, and [`Peers`] holds what a transport that receives notices knows:
//! * an **abort notice** (a peer failed, or found a mismatch, and told every rank): the
//!   peer's error, returned by this and every later call ([`Peers::aborted`]);
//! * an **exit notice** (a peer dropped its communicator, with its call counts per group): a
//!   missing member that exited before reaching this call is [`CommError::PeerExited`];
//! * the **timeout**: [`CommError::Timeout`] naming the members still missing
//!   ([`Peers::check_wait`]).
//!
//! # What a backend provides
//! Only the transport ([`Transport`]): moving the descriptors among the group's members, and
//! deciding what a disagreement does to its world. MPI sends them point to point and polls a
//! control communicator for notices while it waits; it aborts its world on any disagreement
//! (its peers learn of it through an abort notice). NCCL all-gathers them on the device with
//! a deadline; a disagreement leaves its world usable, as no data moved. The encodings are
//! [`crate::codec`]'s. (The thread backend shares memory and compares its [`CallDesc`]s
//! in place; it needs no transport.)

use crate::codec::{self, Descriptor};
use crate::error::{CallDesc, CommError, RankCalls};
use crate::topology::Topology;
use std::time::{Duration, Instant};

/// What a backend must provide for the call agreement.
pub(crate) trait Transport {
    /// Sends `mine` (this rank's encoded call) to every other member of `call.group` and
    /// returns every member's descriptor in group-rank order (this rank's own at its own
    /// index). A wait that cannot complete ends with the transport's error: a peer's abort
    /// notice, a member that exited, the timeout.
    fn exchange(
        &mut self,
        call: &CallDesc,
        mine: &Descriptor,
    ) -> Result<Vec<Descriptor>, CommError>;

    /// Applied to an error the agreement itself found (different calls, an undecodable
    /// descriptor) before it is returned: a transport whose world cannot go on aborts it and
    /// tells its peers; one whose world stays usable returns `e` unchanged.
    fn disagreed(&mut self, e: CommError) -> CommError;
}

/// Runs the agreement for `call` of `rank`: exchanges descriptors among the members of
/// `call.group` (nothing to do in a group of one) and compares them.
///
/// Errors: the transport's; [`CommError::MismatchedCalls`] when the members' calls differ;
/// [`CommError::PeerFailed`] for a descriptor this rank cannot decode.
pub(crate) fn agree<T: Transport + ?Sized>(
    transport: &mut T,
    topology: Topology,
    rank: usize,
    call: &CallDesc,
) -> Result<(), CommError> {
    let members = topology.group_members(call.group, rank);
    if members.len() == 1 {
        return Ok(());
    }
    let all = transport.exchange(call, &codec::encode_call(call))?;
    compare(call, &members, &all).map_err(|e| transport.disagreed(e))
}

/// Compares the members' descriptors (`all[i]` from `members[i]`) with this rank's `call`.
///
/// Errors: [`CommError::PeerFailed`] naming the first member whose descriptor does not decode;
/// [`CommError::MismatchedCalls`] with every member's call when any differs.
pub(crate) fn compare(
    call: &CallDesc,
    members: &[usize],
    all: &[Descriptor],
) -> Result<(), CommError> {
    let mut calls = Vec::with_capacity(members.len());
    let mut same = true;
    for (&m, d) in members.iter().zip(all) {
        let Some(c) = codec::decode_call(d) else {
            return Err(CommError::PeerFailed {
                peer: m,
                reason: format!("sent a collective header this rank cannot decode for {call}"),
            });
        };
        same &= c == *call;
        calls.push((m, c));
    }
    if same {
        Ok(())
    } else {
        Err(CommError::MismatchedCalls {
            calls: RankCalls(calls),
        })
    }
}

/// What one rank knows of its peers from their notices: the error that aborted its world (if
/// any) and, per world rank, its call counts per group when it exited.
#[derive(Debug)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) struct Peers {
    abort: Option<CommError>,
    exited: Vec<Option<[u64; 3]>>,
}

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
impl Peers {
    /// No notice yet, in a world of `world_size` ranks.
    pub(crate) fn new(world_size: usize) -> Peers {
        Peers {
            abort: None,
            exited: vec![None; world_size],
        }
    }

    /// The error that aborted this rank's world, if one did.
    pub(crate) fn aborted(&self) -> Result<(), CommError> {
        match &self.abort {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Records `e` as the abort reason unless one is recorded; true when `e` is the first (the
    /// caller then tells its peers).
    pub(crate) fn abort(&mut self, e: &CommError) -> bool {
        if self.abort.is_some() {
            return false;
        }
        self.abort = Some(e.clone());
        true
    }

    /// Takes an abort notice of `peer` (bytes of [`codec::encode_error`]); the first abort
    /// wins. An undecodable notice is recorded as [`CommError::PeerFailed`] of `peer`.
    pub(crate) fn abort_notice(&mut self, peer: usize, bytes: &[u8]) {
        if self.abort.is_some() {
            return;
        }
        let e = codec::decode_error(&mut codec::Reader(bytes)).unwrap_or_else(|| {
            CommError::PeerFailed {
                peer,
                reason: format!(
                    "sent an abort notice of {} bytes this rank cannot decode",
                    bytes.len()
                ),
            }
        });
        self.abort = Some(e);
    }

    /// Takes an exit notice of `peer` (bytes of [`codec::encode_exit`]); an undecodable one
    /// or one from outside the world is ignored.
    pub(crate) fn exit_notice(&mut self, peer: usize, bytes: &[u8]) {
        if let (Some(calls), Some(slot)) = (codec::decode_exit(bytes), self.exited.get_mut(peer)) {
            *slot = Some(calls);
        }
    }

    /// Checks a wait of `rank` for the members `missing` (world ranks) in `call`, started at
    /// `start`: a missing member that exited before reaching this call, or the timeout passed.
    /// The caller aborts its world with the error.
    ///
    /// Errors: [`CommError::PeerExited`]; [`CommError::Timeout`] naming every missing member.
    pub(crate) fn check_wait(
        &self,
        rank: usize,
        call: &CallDesc,
        missing: &[usize],
        start: Instant,
        timeout: Duration,
    ) -> Result<(), CommError> {
        let gi = codec::group_code(call.group) as usize;
        if let Some((peer, calls)) = missing.iter().find_map(|&m| {
            self.exited
                .get(m)
                .copied()
                .flatten()
                .filter(|c| c[gi] <= call.seq)
                .map(|c| (m, c))
        }) {
            return Err(CommError::PeerExited {
                rank,
                call: *call,
                peer,
                peer_calls: calls.iter().sum(),
            });
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(CommError::Timeout {
                rank,
                call: *call,
                waited_ms: waited.as_millis() as u64,
                missing: missing.to_vec(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::OpKind;
    use crate::topology::{Group, ReduceOp};
    use fsdp_types::DType;

    fn call(seq: u64, n: usize) -> CallDesc {
        CallDesc {
            op: OpKind::AllReduce,
            group: Group::World,
            reduce: Some(ReduceOp::Sum),
            dtype: Some(DType::F32),
            send_numel: n,
            recv_numel: n,
            root: None,
            seq,
        }
    }

    /// A transport over a fixed list of the other members' calls.
    struct Fixed {
        others: Vec<Option<CallDesc>>,
        disagreed: usize,
    }

    impl Transport for Fixed {
        fn exchange(
            &mut self,
            _call: &CallDesc,
            mine: &Descriptor,
        ) -> Result<Vec<Descriptor>, CommError> {
            let mut all = vec![*mine];
            all.extend(self.others.iter().map(|c| match c {
                Some(c) => codec::encode_call(c),
                None => [u64::MAX - 1; codec::CALL_WORDS],
            }));
            Ok(all)
        }

        fn disagreed(&mut self, e: CommError) -> CommError {
            self.disagreed += 1;
            e
        }
    }

    #[test]
    fn equal_calls_agree_and_different_ones_name_every_rank() {
        let topo = Topology::new(3, 1).unwrap();
        let mut t = Fixed {
            others: vec![Some(call(0, 4)), Some(call(0, 4))],
            disagreed: 0,
        };
        assert_eq!(agree(&mut t, topo, 0, &call(0, 4)), Ok(()));
        t.others[1] = Some(call(0, 5));
        assert_eq!(
            agree(&mut t, topo, 0, &call(0, 4)),
            Err(CommError::MismatchedCalls {
                calls: RankCalls(vec![(0, call(0, 4)), (1, call(0, 4)), (2, call(0, 5))]),
            })
        );
        t.others[0] = None;
        assert!(matches!(
            agree(&mut t, topo, 0, &call(0, 4)),
            Err(CommError::PeerFailed { peer: 1, .. })
        ));
        assert_eq!(t.disagreed, 2);
        // A group of one has nobody to agree with.
        let solo = Topology::new(1, 1).unwrap();
        assert_eq!(agree(&mut t, solo, 0, &call(0, 9)), Ok(()));
    }

    #[test]
    fn notices_become_errors() {
        let mut p = Peers::new(3);
        let c = call(2, 4);
        let start = Instant::now();
        assert_eq!(
            p.check_wait(0, &c, &[1, 2], start, Duration::from_secs(60)),
            Ok(())
        );
        // Rank 2 exited after 2 calls on the world: it never reaches call 2.
        p.exit_notice(2, &codec::encode_exit([2, 0, 0]));
        assert_eq!(
            p.check_wait(0, &c, &[1, 2], start, Duration::from_secs(60)),
            Err(CommError::PeerExited {
                rank: 0,
                call: c,
                peer: 2,
                peer_calls: 2,
            })
        );
        assert!(matches!(
            p.check_wait(0, &c, &[1], start, Duration::ZERO),
            Err(CommError::Timeout { ref missing, .. }) if missing == &[1]
        ));
        assert_eq!(p.aborted(), Ok(()));
        p.abort_notice(1, b"garbage");
        assert!(matches!(
            p.aborted(),
            Err(CommError::PeerFailed { peer: 1, .. })
        ));
        assert!(!p.abort(&CommError::PeerFailed {
            peer: 0,
            reason: "later".into()
        }));
    }
}
