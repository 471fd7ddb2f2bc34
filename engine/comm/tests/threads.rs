//! Thread-backend specifics beyond the shared conformance suite: properties over random worlds
//! and sizes, started calls, launcher behaviour.

use fsdp_comm::{
    reduce_in_rank_order, run_threads, thread_communicators, Buf, CommError, Communicator, Group,
    OwnedBuf, ReduceOp, Topology, DEFAULT_TIMEOUT,
};
use proptest::prelude::*;
use std::time::Duration;

fn rank_values(rank: usize, n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (rank as u32 + 1)
                .wrapping_mul(2_654_435_761)
                .wrapping_add((i as u32).wrapping_mul(40503))
                ^ seed;
            // Mixed magnitudes so that the summation order changes the rounding.
            ((h % 2001) as f32 - 1000.0) * [1e-3f32, 1.0, 1e5][(h >> 12) as usize % 3]
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// all-reduce(sum) == sequential f32 sum in rank order, and reduce-scatter followed by
    /// all-gather gives the same bits, for random world sizes, hybrid shapes and lengths.
    #[test]
    fn all_reduce_equals_rank_order_sum_and_rs_ag(
        shard in 1usize..5, replicate in 1usize..3, n in 0usize..300, seed in any::<u32>()
    ) {
        let topo = Topology::new(shard, replicate).unwrap();
        let w = topo.world_size;
        let res = run_threads(topo, DEFAULT_TIMEOUT, |c| {
            let mine = rank_values(c.rank(), n * w, seed);
            let mut ar = mine.clone();
            c.all_reduce(Group::World, ReduceOp::Sum, (&mut ar).into())?;
            let mut shard_out = vec![0.0f32; n];
            c.reduce_scatter(Group::World, ReduceOp::Sum, (&mine).into(), (&mut shard_out).into())?;
            let mut gathered = vec![0.0f32; n * w];
            c.all_gather(Group::World, (&shard_out).into(), (&mut gathered).into())?;
            Ok::<_, CommError>((ar, gathered))
        });
        let mut expect = rank_values(0, n * w, seed);
        for r in 1..w {
            for (e, x) in expect.iter_mut().zip(rank_values(r, n * w, seed)) {
                *e += x;
            }
        }
        for r in res {
            let (ar, gathered) = r.unwrap().unwrap();
            prop_assert!(ar.iter().zip(&expect).all(|(a, b)| a.to_bits() == b.to_bits()));
            prop_assert!(gathered.iter().zip(&expect).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}

#[test]
fn started_all_gather_reports_completion_and_returns_buffers() {
    let topo = Topology::fully_sharded(3).unwrap();
    let res = run_threads(topo, DEFAULT_TIMEOUT, |c| {
        let send = OwnedBuf::from(vec![c.rank() as f64; 5]);
        let op = c.start_all_gather(
            Group::World,
            send,
            OwnedBuf::zeros(fsdp_comm::DType::F64, 15),
        )?;
        let call = *op.call();
        let done = op.wait_all()?;
        Ok::<_, CommError>((call, done))
    });
    for (rank, r) in res.into_iter().enumerate() {
        let (call, done) = r.unwrap().unwrap();
        assert_eq!(call.recv_numel, 15);
        assert_eq!(done.send, Some(OwnedBuf::F64(vec![rank as f64; 5])));
        let want: Vec<f64> = (0..3).flat_map(|r| vec![r as f64; 5]).collect();
        assert_eq!(done.buf.to_f64_vec(), want);
    }
}

#[test]
fn started_call_with_bad_buffers_fails_at_issue() {
    let mut comms =
        thread_communicators(Topology::fully_sharded(1).unwrap(), DEFAULT_TIMEOUT).unwrap();
    let c = comms.pop().unwrap();
    let e = c
        .start_reduce_scatter(
            Group::World,
            ReduceOp::Avg,
            OwnedBuf::from(vec![1.0f32; 4]),
            OwnedBuf::from(vec![0.0f32; 3]),
        )
        .unwrap_err();
    assert_eq!(
        e,
        CommError::SizeMismatch {
            rank: 0,
            op: fsdp_comm::OpKind::ReduceScatter,
            group: Group::World,
            group_size: 1,
            what: "send",
            expected: 3,
            got: 4
        }
    );
    // World size 1 on the calling thread: collectives are copies and Avg divides by 1.
    let mut x = vec![3.0f32, -1.5];
    c.all_reduce(Group::World, ReduceOp::Avg, (&mut x).into())
        .unwrap();
    assert_eq!(x, vec![3.0, -1.5]);
}

#[test]
fn dropped_pending_op_does_not_block_later_calls() {
    let topo = Topology::fully_sharded(2).unwrap();
    let res = run_threads(topo, DEFAULT_TIMEOUT, |c| {
        drop(c.start_all_reduce(
            Group::World,
            ReduceOp::Sum,
            OwnedBuf::from(vec![1.0f32; 64]),
        )?);
        let mut x = vec![c.rank() as f32; 2];
        c.all_reduce(Group::World, ReduceOp::Max, (&mut x).into())?;
        Ok::<_, CommError>(x)
    });
    for r in res {
        assert_eq!(r.unwrap().unwrap(), vec![1.0, 1.0]);
    }
}

#[test]
fn invalid_topology_is_reported_per_rank() {
    let bad = Topology {
        world_size: 3,
        shard_size: 2,
        replicate_size: 2,
    };
    let res = run_threads(bad, DEFAULT_TIMEOUT, |_c| ());
    assert_eq!(res.len(), 3);
    assert!(matches!(
        res[0],
        Err(CommError::InvalidTopology { world_size: 3, .. })
    ));
}

#[test]
fn reference_reduction_rejects_mixed_dtypes() {
    let a = vec![1.0f32; 2];
    let b = vec![1.0f64; 2];
    let mut out = vec![0.0f32; 2];
    let e = reduce_in_rank_order(
        &[Buf::from(&a), Buf::from(&b)],
        ReduceOp::Sum,
        (&mut out).into(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("f64"), "{e}");
}

#[test]
fn after_a_failure_every_later_call_fails_fast() {
    let topo = Topology::fully_sharded(2).unwrap();
    let res = run_threads(topo, Duration::from_secs(10), |c| {
        let mut x = vec![1.0f32; 4 + c.rank()];
        let first = c.all_reduce(Group::World, ReduceOp::Sum, (&mut x).into());
        let t = std::time::Instant::now();
        let second = c.barrier(Group::World);
        (first.is_err(), second.is_err(), t.elapsed())
    });
    for r in res {
        let (a, b, took) = r.unwrap();
        assert!(a && b);
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}

#[test]
fn multi_mebibyte_copies_are_exact() {
    // Shards of 5 MiB + 4 bytes (odd length) and an all-reduce whose gathered chunks are as big.
    let shard = (5 << 20) / 4 + 1;
    let topo = Topology::fully_sharded(2).unwrap();
    let res = run_threads(topo, DEFAULT_TIMEOUT, |c| {
        let send: Vec<f32> = (0..shard).map(|i| (i * 2 + c.rank()) as f32).collect();
        let mut recv = vec![0.0f32; 2 * shard];
        c.all_gather(Group::World, (&send).into(), (&mut recv).into())?;
        let mut ar: Vec<f32> = (0..2 * shard)
            .map(|i| (i % 1000) as f32 * (c.rank() + 1) as f32)
            .collect();
        c.all_reduce(Group::World, ReduceOp::Sum, (&mut ar).into())?;
        Ok::<_, CommError>((recv, ar))
    });
    for r in res {
        let (recv, ar) = r.unwrap().unwrap();
        for (j, x) in recv.iter().enumerate() {
            let (owner, i) = (j / shard, j % shard);
            assert_eq!(*x, (i * 2 + owner) as f32, "all-gather element {j}");
        }
        for (i, x) in ar.iter().enumerate() {
            assert_eq!(*x, (i % 1000) as f32 * 3.0, "all-reduce element {i}");
        }
    }
}
