//! Padding for parameter sizes not divisible by the world size. DeepSpeed's ZeRO-3 fp32
//! consolidation handled such padding wrongly
//! (<https://github.com/deepspeedai/DeepSpeed/pull/1380>), and loading a full state dict failed
//! for a parameter with fewer rows than ranks (<https://github.com/pytorch/pytorch/issues/136228>).
//! Parameters `A [7,3]`, `B [5]`, `C [1,17]`, `D [3]` (46 f32 elements, element k = k + 0.5) in
//! one unit; W in {1, 2, 3, 4, 5, 8}.

use fsdp_planner::{plan, Architecture, ModelSpec, ParamSpec, PlanConfig, UnitSpec};

fn uneven_spec() -> ModelSpec {
    ModelSpec {
        name: "uneven".into(),
        units: vec![UnitSpec {
            name: "u".into(),
            params: vec![
                ParamSpec::new("A", &[7, 3]),
                ParamSpec::new("B", &[5]),
                ParamSpec::new("C", &[1, 17]),
                ParamSpec::new("D", &[3]),
            ],
        }],
        arch: Architecture::Generic,
    }
}

#[test]
fn padding_numbers_per_world_size() {
    for (w, padding) in [(1u64, 0u64), (2, 0), (3, 2), (4, 2), (5, 4), (8, 2)] {
        let p = plan(&uneven_spec(), &PlanConfig::new(w)).unwrap();
        let f = &p.units[0].flat_params[0];
        assert_eq!(f.real_numel().0, 46);
        assert_eq!(p.padding.padding_numel.0, padding, "W={w}");
        assert_eq!(f.shard_numel().0 * w - 46, padding, "W={w}");
        let real: u64 = (0..w).map(|i| f.shard_real_numel(i).0).sum();
        let pad: u64 = (0..w).map(|i| p.shard_padding_numel(i).0).sum();
        assert_eq!(real, 46, "W={w}");
        assert_eq!(pad, padding, "W={w}");
        // Master shards: 4 bytes per shard element, padding included, on every rank.
        assert_eq!(
            p.memory.phases[2].at_peak.param_shards.0,
            4 * f.shard_numel().0,
            "W={w}"
        );
    }
}

#[test]
fn padding_shard_unshard_is_bitwise_with_empty_shares() {
    for w in [1u64, 2, 3, 4, 5, 8] {
        let p = plan(&uneven_spec(), &PlanConfig::new(w)).unwrap();
        let f = &p.units[0].flat_params[0];
        let mut k = 0.0f32;
        let data: Vec<Vec<f32>> = f
            .segments
            .iter()
            .map(|s| {
                (0..s.numel.0)
                    .map(|_| {
                        k += 1.0;
                        k - 0.5
                    })
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = data.iter().map(Vec::as_slice).collect();
        let flat = f.flatten(&refs);
        let shards: Vec<Vec<f32>> = (0..w).map(|i| f.shard_of(&flat, i)).collect();
        // Padding is exactly zero and lives only at the tail.
        assert!(flat[46..].iter().all(|x| x.to_bits() == 0));
        let srefs: Vec<&[f32]> = shards.iter().map(Vec::as_slice).collect();
        let back = f.unshard(&srefs);
        for (i, d) in data.iter().enumerate() {
            assert_eq!(f.view(&back, i), d.as_slice(), "W={w} param {i}");
        }
        assert_eq!(f.segments[2].shape, vec![1, 17]);
        if w >= 4 {
            // Some rank holds nothing of D (3 elements) and the layout still says so.
            let empty = (0..w)
                .filter(|&i| !f.shard_slices(i).iter().any(|s| s.segment == 3))
                .count();
            assert!(empty as u64 >= w - 2, "W={w}: {empty} ranks without D");
        }
    }
}
