//! Process groups: how the world splits into shard groups and replicate groups.
//!
//! Hybrid sharding (HSDP, "Zhao et al., PyTorch FSDP: Experiences on Scaling Fully Sharded Data
//! Parallel", VLDB 2023, section 3.2.2) arranges the `W = S x R` ranks as a grid: each row is a
//! shard group of `S` contiguous ranks that shards parameters; each column is a replicate group
//! of `R` ranks that holds identical shards and all-reduces gradients.

use crate::error::CommError;
use std::fmt;

/// A set of ranks a collective runs over.
///
/// For rank `r` of a [`Topology`] with shard size `S`:
/// * [`Group::World`]: all `W` ranks; the group rank is `r`.
/// * [`Group::Shard`]: ranks `(r / S) * S .. (r / S) * S + S` (contiguous); group rank `r % S`.
/// * [`Group::Replicate`]: ranks `r % S, r % S + S, r % S + 2S, ...`; group rank `r / S`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// Every rank of the world.
    World,
    /// The shard group of the calling rank (same replicate index).
    Shard,
    /// The replicate group of the calling rank (same shard index).
    Replicate,
}

impl Group {
    /// Lowercase name used in error messages (`world`, `shard`, `replicate`).
    pub const fn name(self) -> &'static str {
        match self {
            Group::World => "world",
            Group::Shard => "shard",
            Group::Replicate => "replicate",
        }
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The world size and its factorisation `world_size = shard_size x replicate_size`.
///
/// Rank `r` has `replicate_index = r / shard_size` and `shard_index = r % shard_size`; the ranks of
/// one shard group are contiguous. FSDP is `replicate_size = 1`, DDP is `shard_size = 1`, hybrid
/// sharding has both above 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Topology {
    /// Number of ranks, `W >= 1`.
    pub world_size: usize,
    /// Ranks per shard group, `S >= 1`.
    pub shard_size: usize,
    /// Ranks per replicate group, `R >= 1`, with `S x R = W`.
    pub replicate_size: usize,
}

impl Topology {
    /// A checked topology of `shard_size x replicate_size` ranks.
    ///
    /// Errors: [`CommError::InvalidTopology`] if either factor is 0.
    pub fn new(shard_size: usize, replicate_size: usize) -> Result<Topology, CommError> {
        if shard_size == 0 || replicate_size == 0 {
            return Err(CommError::InvalidTopology {
                world_size: shard_size * replicate_size,
                shard_size,
                replicate_size,
                reason: "shard_size and replicate_size must both be at least 1",
            });
        }
        Ok(Topology {
            world_size: shard_size * replicate_size,
            shard_size,
            replicate_size,
        })
    }

    /// Fully sharded: one shard group of `world_size` ranks (`replicate_size = 1`).
    ///
    /// Errors: [`CommError::InvalidTopology`] if `world_size` is 0.
    pub fn fully_sharded(world_size: usize) -> Result<Topology, CommError> {
        Topology::new(world_size, 1)
    }

    /// Checks `world_size = shard_size x replicate_size` with every factor at least 1.
    ///
    /// Errors: [`CommError::InvalidTopology`] naming the three numbers.
    pub fn validate(&self) -> Result<(), CommError> {
        if self.shard_size == 0 || self.replicate_size == 0 {
            return Err(CommError::InvalidTopology {
                world_size: self.world_size,
                shard_size: self.shard_size,
                replicate_size: self.replicate_size,
                reason: "shard_size and replicate_size must both be at least 1",
            });
        }
        if self.shard_size.checked_mul(self.replicate_size) != Some(self.world_size) {
            return Err(CommError::InvalidTopology {
                world_size: self.world_size,
                shard_size: self.shard_size,
                replicate_size: self.replicate_size,
                reason: "world_size must equal shard_size x replicate_size",
            });
        }
        Ok(())
    }

    /// `(replicate_index, shard_index) = (rank / shard_size, rank % shard_size)`.
    pub const fn coords(&self, rank: usize) -> (usize, usize) {
        (rank / self.shard_size, rank % self.shard_size)
    }

    /// Number of ranks in `group`: `W`, `S` or `R`.
    pub const fn group_size(&self, group: Group) -> usize {
        match group {
            Group::World => self.world_size,
            Group::Shard => self.shard_size,
            Group::Replicate => self.replicate_size,
        }
    }

    /// The position of `rank` inside its `group` (0-based): `rank`, `rank % S` or `rank / S`.
    pub const fn group_rank(&self, group: Group, rank: usize) -> usize {
        match group {
            Group::World => rank,
            Group::Shard => rank % self.shard_size,
            Group::Replicate => rank / self.shard_size,
        }
    }

    /// The world ranks of `rank`'s `group`, in group-rank order.
    pub fn group_members(&self, group: Group, rank: usize) -> Vec<usize> {
        let (ri, si) = self.coords(rank);
        match group {
            Group::World => (0..self.world_size).collect(),
            Group::Shard => (ri * self.shard_size..(ri + 1) * self.shard_size).collect(),
            Group::Replicate => (0..self.replicate_size)
                .map(|k| si + k * self.shard_size)
                .collect(),
        }
    }

    /// A dense index of the group instance `rank` belongs to: 0 for the world, `1 + replicate_index`
    /// for shard groups, `1 + R + shard_index` for replicate groups. There are `1 + R + S`
    /// instances; a shard group and the world are distinct instances even when they hold the same
    /// ranks, so a rank calling on `World` never pairs with one calling on `Shard`.
    pub const fn group_instance(&self, group: Group, rank: usize) -> usize {
        match group {
            Group::World => 0,
            Group::Shard => 1 + rank / self.shard_size,
            Group::Replicate => 1 + self.replicate_size + rank % self.shard_size,
        }
    }

    /// Number of distinct group instances: `1 + R + S`.
    pub const fn num_group_instances(&self) -> usize {
        1 + self.replicate_size + self.shard_size
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "world {} = shard {} x replicate {}",
            self.world_size, self.shard_size, self.replicate_size
        )
    }
}

/// How a reduction combines the contributions of a group's ranks.
///
/// Every backend sums in rank order (`((x_0 + x_1) + x_2) + ...`); `Avg` then divides by the number
/// of ranks of the group exactly once (never by an element count:
/// <https://github.com/meta-pytorch/torchcomms/pull/287>). 16-bit inputs are accumulated in f32 and
/// rounded once at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum in rank order.
    Sum,
    /// Element-wise sum in rank order, then one division by the group size.
    Avg,
    /// Element-wise maximum; a NaN in any contribution makes the result NaN.
    Max,
}

impl ReduceOp {
    /// Lowercase name (`sum`, `avg`, `max`).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_2x3_coordinates() {
        let t = Topology::new(3, 2).unwrap();
        assert_eq!(t.world_size, 6);
        assert_eq!(t.coords(4), (1, 1));
        assert_eq!(t.group_members(Group::Shard, 4), vec![3, 4, 5]);
        assert_eq!(t.group_members(Group::Replicate, 4), vec![1, 4]);
        assert_eq!(t.group_rank(Group::Shard, 4), 1);
        assert_eq!(t.group_rank(Group::Replicate, 4), 1);
        assert_eq!(t.group_instance(Group::Shard, 4), 2);
        assert_eq!(t.group_instance(Group::Replicate, 4), 1 + 2 + 1);
        assert_eq!(t.num_group_instances(), 6);
    }

    #[test]
    fn invalid_topologies_are_errors() {
        assert!(Topology::new(0, 2).is_err());
        let bad = Topology {
            world_size: 5,
            shard_size: 2,
            replicate_size: 2,
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains('5') && e.contains("shard_size"), "{e}");
    }
}
