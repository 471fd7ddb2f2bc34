//! Property tests over random model specs (1..20 units, 1..10 params each, 0..4 dims with
//! size-1 dims and 1-element params, some frozen, sometimes a tied parameter) and world sizes
//! 1..16: the layout tiles, shards tile equally, slices add up, shard -> unshard is a bitwise
//! round trip, the plan is deterministic and rank-independent, and model-state bytes match an
//! independent computation.

use fsdp_planner::{
    layout_units, plan, Architecture, ModelSpec, ParamSpec, PlanConfig, Strategy as Sharding,
    UnitSpec,
};
use proptest::prelude::*;

fn param_strategy() -> impl Strategy<Value = (Vec<u64>, bool)> {
    (
        prop::collection::vec(prop_oneof![Just(1u64), 1u64..7], 0..4),
        prop::bool::weighted(0.2),
    )
}

fn spec_strategy() -> impl Strategy<Value = ModelSpec> {
    (
        prop::collection::vec(prop::collection::vec(param_strategy(), 1..10), 1..20),
        any::<bool>(),
    )
        .prop_map(|(units, tie)| {
            let n = units.len();
            let mut units: Vec<UnitSpec> = units
                .into_iter()
                .enumerate()
                .map(|(ui, ps)| UnitSpec {
                    name: format!("u{ui}"),
                    params: ps
                        .into_iter()
                        .enumerate()
                        .map(|(pi, (shape, frozen))| {
                            let mut p = ParamSpec::new(format!("u{ui}.p{pi}"), &shape);
                            p.trainable = !frozen;
                            p
                        })
                        .collect(),
                })
                .collect();
            if tie {
                let last = &mut units[n - 1];
                let target = last.params[0].clone();
                let mut t = ParamSpec::new(format!("u{}.tied", n - 1), &target.shape);
                t.tied_to = Some(target.name.clone());
                last.params.push(t);
            }
            ModelSpec {
                name: "random".into(),
                units,
                arch: Architecture::Generic,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn layout_tiles_and_round_trips(spec in spec_strategy(), world in 1u64..=16, align in prop_oneof![Just(1u64), 1u64..5], seed in any::<u32>()) {
        let units = layout_units(&spec, world, align).unwrap();
        let mut counter = seed;
        for (ui, u) in units.iter().enumerate() {
            let spec_u = &spec.units[ui];
            let non_tied = spec_u.params.iter().filter(|p| p.tied_to.is_none()).count();
            let segs: usize = u.flat_params.iter().map(|f| f.segments.len()).sum();
            prop_assert_eq!(segs, non_tied);
            for f in &u.flat_params {
                // Segments tile [0, unpadded) in order without overlap (gaps only for alignment).
                let mut end = 0u64;
                for s in &f.segments {
                    prop_assert!(s.offset.0 >= end);
                    prop_assert_eq!(s.offset.0 % align, 0);
                    prop_assert!(s.offset.0 - end < align);
                    if align == 1 { prop_assert_eq!(s.offset.0, end); }
                    prop_assert_eq!(s.numel.0, spec_u.params[s.param_index].numel().0);
                    prop_assert_eq!(spec_u.params[s.param_index].trainable, f.trainable);
                    end = s.offset.0 + s.numel.0;
                }
                prop_assert_eq!(end, f.unpadded_numel.0);
                // Shards tile [0, padded) equally.
                prop_assert_eq!(f.padded_numel.0 % (world * align), 0);
                prop_assert!(f.padded_numel.0 - f.unpadded_numel.0 < world * align);
                let mut next = 0;
                for i in 0..world {
                    let r = f.shard_range(i);
                    prop_assert_eq!(r.start, next);
                    prop_assert_eq!(r.end - r.start, f.shard_numel().0);
                    next = r.end;
                }
                prop_assert_eq!(next, f.padded_numel.0);
                // Slices add up: per segment they cover [0, numel) in order.
                let mut covered = vec![0u64; f.segments.len()];
                let mut total = 0;
                for i in 0..world {
                    for sl in f.shard_slices(i) {
                        prop_assert_eq!(sl.param_offset.0, covered[sl.segment]);
                        prop_assert!(sl.shard_offset.0 + sl.numel.0 <= f.shard_numel().0);
                        covered[sl.segment] += sl.numel.0;
                        total += sl.numel.0;
                    }
                }
                for (k, s) in f.segments.iter().enumerate() { prop_assert_eq!(covered[k], s.numel.0); }
                prop_assert_eq!(total, f.real_numel().0);
                // Shard then unshard returns every tensor bitwise (arbitrary bit patterns, NaNs included).
                let data: Vec<Vec<f32>> = f.segments.iter().map(|s| (0..s.numel.0).map(|_| {
                    counter = counter.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    f32::from_bits(counter)
                }).collect()).collect();
                let refs: Vec<&[f32]> = data.iter().map(|v| v.as_slice()).collect();
                let flat = f.flatten(&refs);
                let shards: Vec<Vec<f32>> = (0..world).map(|i| f.shard_of(&flat, i)).collect();
                let srefs: Vec<&[f32]> = shards.iter().map(|v| v.as_slice()).collect();
                let back = f.unshard(&srefs);
                for (k, orig) in data.iter().enumerate() {
                    let got = f.view(&back, k);
                    prop_assert!(got.iter().zip(orig).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
                // Padding is zero.
                let real: u64 = f.segments.iter().map(|s| s.numel.0).sum();
                prop_assert_eq!(back.iter().filter(|x| x.to_bits() != 0).count() as u64 <= real, true);
            }
        }
    }

    #[test]
    fn plan_is_deterministic_and_rank_independent(spec in spec_strategy(), world in 1u64..=16, full in any::<bool>()) {
        let mut cfg = PlanConfig::new(world);
        cfg.strategy = if full { Sharding::FullShard } else { Sharding::ShardGradOp };
        let a = plan(&spec, &cfg).unwrap();
        let b = plan(&spec.clone(), &cfg.clone()).unwrap();
        prop_assert_eq!(a.fingerprint(), b.fingerprint());
        prop_assert_eq!(a.fingerprint().len(), 64);
        prop_assert_eq!(&a, &b);
        for r in 0..world {
            let pr = a.rank(r).unwrap();
            prop_assert_eq!(pr.shard_index, r % world);
            prop_assert_eq!(pr.replicate_index, 0);
            prop_assert_eq!(a.memory_for_rank(r).unwrap(), &a.memory);
        }
        prop_assert!(a.rank(world).is_err());
        // Model states per rank against an independent count: ceil(n/S) per flat param.
        let (mut all, mut tr) = (0u64, 0u64);
        for u in &spec.units {
            let t: u64 = u.params.iter().filter(|p| p.tied_to.is_none() && p.trainable).map(|p| p.numel().0).sum();
            let f: u64 = u.params.iter().filter(|p| p.tied_to.is_none() && !p.trainable).map(|p| p.numel().0).sum();
            all += t.div_ceil(world) + f.div_ceil(world);
            tr += t.div_ceil(world);
        }
        let ob = a.memory.phase(fsdp_planner::Phase::OptimizerStep).at_peak;
        prop_assert_eq!(ob.param_shards.0, 4 * all);
        prop_assert_eq!(ob.grad_shards.0, 4 * tr);
        prop_assert_eq!(ob.optimizer_state.0, 8 * tr);
        prop_assert_eq!(a.padding.real_numel, spec.numel());
    }
}
