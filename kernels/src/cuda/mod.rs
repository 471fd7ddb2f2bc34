//! CUDA versions of the flat-buffer kernels, and the host-side work they need.
//!
//! The kernels ([`SOURCE`], `kernels.cu` beside this file) are compiled by NVRTC the first time
//! a `CudaKernels` (feature `cuda`) is used on a device, with `--fmad=false --prec-div=true
//! --prec-sqrt=true --ftz=false`, and run on a stream the caller gives. They mirror the CPU
//! reference of this crate and are tested against it on random inputs (`tests/cuda_kernels.rs`):
//!
//! | CUDA kernel | CPU reference | bound vs the CPU |
//! |---|---|---|
//! | `adamw_step` | [`crate::adamw_step`] | bitwise equal (0 ulp) |
//! | `sgd_step` | [`crate::sgd_step`] | bitwise equal |
//! | `scale`, `div_scalar`, `accumulate` | [`crate::scale`], [`crate::div_scalar`], [`crate::accumulate`] | bitwise equal |
//! | `accumulate_bf16` / `_f16` / `_f64` | widening cast, then [`crate::accumulate`] | bitwise equal |
//! | `max_abs` | [`crate::max_abs`] | bitwise equal (a NaN result is NaN) |
//! | casts f32 <-> bf16 / f16 | [`crate::cast`] | bitwise equal; NaN stays NaN (f16: canonical payload) |
//! | `sum_squares` | [`crate::sum_squares`] | relative error <= gamma(n-1) = (n-1)u / (1-(n-1)u), u = 2^-53 |
//!
//! Bitwise equality holds because each element goes through the same IEEE-754 operations in the
//! same order, each rounded to nearest even and never fused (explicit `__fadd_rn`-style
//! intrinsics). The sum of squares adds the same exact f64 squares in a different (fixed) order
//! — per tile, a strided per-thread sum and a binary tree, then the tiles in order — so it is
//! deterministic (same input and spans, same bits, whatever the grid) but not equal to the
//! sequential CPU sum; the bound is the standard one for summing n non-negative terms in any
//! order (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed. 2002, section 4.2).
//!
//! This module's host logic is built without the feature too, so it is tested everywhere:
//! [`tiles_for_spans`] (span packing into the tile table the span kernels read), [`grid_1d`]
//! and [`tile_grid`] (launch configuration), [`probe`] (is there a CUDA device: the tests' skip
//! path).

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub use device::{compile_ptx_for, CudaKernels, DeviceSpans};

use crate::error::KernelError;
use crate::span::{validate_spans, Span};

/// The CUDA C source of every kernel (compiled by NVRTC at first use).
pub const SOURCE: &str = include_str!("kernels.cu");

/// Threads per block of every kernel (a power of two; `FSDP_BLOCK` in [`SOURCE`]).
pub const BLOCK: u32 = 256;

/// Elements per tile of the span kernels: one block handles one tile at a time.
pub const TILE: usize = 4096;

/// Most blocks launched for one kernel (blocks loop over the work beyond it).
pub const MAX_BLOCKS: u32 = 1 << 20;

/// Kernel names in [`SOURCE`], in the order `CudaKernels` loads them.
pub const KERNEL_NAMES: [&str; 16] = [
    "fsdp_adamw_tiles",
    "fsdp_sumsq_tiles",
    "fsdp_sum_f64",
    "fsdp_scale",
    "fsdp_accumulate",
    "fsdp_f32_to_bf16",
    "fsdp_bf16_to_f32",
    "fsdp_f32_to_f16",
    "fsdp_f16_to_f32",
    "fsdp_sgd_tiles",
    "fsdp_maxabs_tiles",
    "fsdp_max_f32",
    "fsdp_div_scalar",
    "fsdp_accumulate_bf16",
    "fsdp_accumulate_f16",
    "fsdp_accumulate_f64",
];

/// NVRTC options: no fused multiply-add, IEEE division and square root, no flush to zero.
pub const NVRTC_OPTIONS: [&str; 4] = [
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
];

/// One tile of the tile table: `len <= TILE` elements from element `start` of a span, with the
/// span's weight-decay flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    /// First element (elements from the start of the buffer).
    pub start: usize,
    /// Number of elements, `1..=TILE`.
    pub len: usize,
    /// The span's weight-decay flag.
    pub weight_decay: bool,
}

impl Tile {
    /// The two `u64` words the kernels read: `start`, and `len | weight_decay << 32`.
    pub fn words(&self) -> [u64; 2] {
        [
            self.start as u64,
            self.len as u64 | (u64::from(self.weight_decay) << 32),
        ]
    }
}

/// Cuts `spans` (sorted, disjoint, inside a buffer of `buffer_len` elements) into tiles of at
/// most `TILE` elements, in span order; empty spans give no tile. Padding (elements in no span)
/// is in no tile.
///
/// Errors: [`KernelError::SpanOutOfBounds`], [`KernelError::SpansOverlap`].
pub fn tiles_for_spans(spans: &[Span], buffer_len: usize) -> Result<Vec<Tile>, KernelError> {
    validate_spans(spans, buffer_len)?;
    let mut tiles = Vec::new();
    for s in spans {
        let mut at = s.start;
        let end = s.start + s.len;
        while at < end {
            let len = (end - at).min(TILE);
            tiles.push(Tile {
                start: at,
                len,
                weight_decay: s.weight_decay,
            });
            at += len;
        }
    }
    Ok(tiles)
}

/// The flat `u64` table of `tiles` (2 words per tile) as uploaded to the device.
pub fn tile_words(tiles: &[Tile]) -> Vec<u64> {
    tiles.iter().flat_map(Tile::words).collect()
}

/// Blocks for an element-wise kernel over `n` elements with [`BLOCK`] threads per block and a
/// grid-stride loop: `ceil(n / BLOCK)`, at least 1, at most [`MAX_BLOCKS`].
pub fn grid_1d(n: usize) -> u32 {
    let blocks = n.div_ceil(BLOCK as usize).max(1);
    blocks.min(MAX_BLOCKS as usize) as u32
}

/// Blocks for a tile kernel over `n_tiles` tiles: one per tile, at least 1, at most
/// [`MAX_BLOCKS`] (blocks then loop over tiles).
pub fn tile_grid(n_tiles: usize) -> u32 {
    n_tiles.clamp(1, MAX_BLOCKS as usize) as u32
}

/// Whether a CUDA device can be used by this build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// This many devices are visible.
    Available(usize),
    /// No device can be used, and why (no `cuda` feature, no driver, no device).
    Unavailable(String),
}

/// Looks for a CUDA device: without the `cuda` feature always
/// [`Probe::Unavailable`]`("built without the cuda feature")`; with it, initialises the driver
/// and counts devices (a missing driver or zero devices is `Unavailable` with the driver's text).
pub fn probe() -> Probe {
    #[cfg(feature = "cuda")]
    {
        device::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Probe::Unavailable("built without the `cuda` feature".into())
    }
}

/// The name of CUDA device `ordinal` as the driver reports it (`NVIDIA H200`): `None`
/// without the `cuda` feature, or when the driver, the device or its name cannot be had.
pub fn device_name(ordinal: usize) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        device::device_name(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        None
    }
}

/// The environment variable that turns a CUDA test's skip into a failure: set it to `1` where
/// a device must be present (the GPU machine), so that a missing device, driver or library
/// fails the test instead of letting it pass without running.
pub const REQUIRE_CUDA_VAR: &str = "FSDP_REQUIRE_CUDA";

/// The tests' skip rule: `true` when a device is available; otherwise prints
/// `SKIPPED (no CUDA device): <test> (<reason>)` to stderr and returns `false` (libtest shows
/// the line only with `--nocapture`: the CUDA tests are also marked `ignore` in builds without
/// the `cuda` feature, so that `cargo test` lists them as ignored). With
/// [`REQUIRE_CUDA_VAR`]`=1` in the environment a missing device panics instead.
pub fn device_or_skip(test: &str) -> bool {
    skip_rule(
        test,
        probe(),
        required(std::env::var(REQUIRE_CUDA_VAR).ok()),
    )
}

/// Whether a `FSDP_REQUIRE_*` variable's value asks for the dependency: exactly `1`.
fn required(value: Option<String>) -> bool {
    value.as_deref() == Some("1")
}

fn skip_rule(test: &str, probe: Probe, require: bool) -> bool {
    match probe {
        Probe::Available(_) => true,
        Probe::Unavailable(why) if require => {
            panic!("{test}: {REQUIRE_CUDA_VAR}=1 but no CUDA device: {why}")
        }
        Probe::Unavailable(why) => {
            eprintln!("SKIPPED (no CUDA device): {test} ({why})");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_rule_skips_or_fails_as_required() {
        let none = || Probe::Unavailable("no driver".into());
        assert!(!skip_rule("t", none(), false));
        let failed = std::panic::catch_unwind(|| skip_rule("t", none(), true));
        let msg = failed.expect_err("a required device that is missing fails");
        let msg = msg.downcast_ref::<String>().unwrap();
        assert_eq!(msg, "t: FSDP_REQUIRE_CUDA=1 but no CUDA device: no driver");
        assert!(required(Some("1".into())));
        for v in [None, Some("0".into()), Some("".into()), Some("yes".into())] {
            assert!(!required(v.clone()), "{v:?}");
        }
    }

    #[test]
    fn tiles_cover_exactly_the_spans_in_order() {
        let spans = [
            Span::new(3, 0, true),
            Span::new(5, TILE + 7, true),
            Span::new(TILE + 20, 1, false),
            Span::new(3 * TILE, 2 * TILE, false),
        ];
        let n = 5 * TILE + 1;
        let tiles = tiles_for_spans(&spans, n).unwrap();
        assert_eq!(
            tiles,
            vec![
                Tile {
                    start: 5,
                    len: TILE,
                    weight_decay: true
                },
                Tile {
                    start: 5 + TILE,
                    len: 7,
                    weight_decay: true
                },
                Tile {
                    start: TILE + 20,
                    len: 1,
                    weight_decay: false
                },
                Tile {
                    start: 3 * TILE,
                    len: TILE,
                    weight_decay: false
                },
                Tile {
                    start: 4 * TILE,
                    len: TILE,
                    weight_decay: false
                },
            ]
        );
        // Every element is in at most one tile, and in one exactly when it is in a span.
        let mut covered = vec![0u8; n];
        for t in &tiles {
            assert!(t.len >= 1 && t.len <= TILE);
            for c in &mut covered[t.start..t.start + t.len] {
                *c += 1;
            }
        }
        for (i, c) in covered.iter().enumerate() {
            let in_span = spans.iter().any(|s| s.range().contains(&i));
            assert_eq!(*c, u8::from(in_span), "element {i}");
        }
    }

    #[test]
    fn tile_words_pack_start_len_and_decay() {
        let t = Tile {
            start: 1 << 40,
            len: 17,
            weight_decay: true,
        };
        assert_eq!(t.words(), [1 << 40, 17 | (1 << 32)]);
        let w = tile_words(&[
            t,
            Tile {
                start: 2,
                len: TILE,
                weight_decay: false,
            },
        ]);
        assert_eq!(w, vec![1 << 40, 17 | (1 << 32), 2, TILE as u64]);
    }

    #[test]
    fn bad_spans_are_rejected_before_any_tile() {
        assert!(matches!(
            tiles_for_spans(&[Span::new(0, 11, false)], 10),
            Err(KernelError::SpanOutOfBounds { index: 0, .. })
        ));
        assert!(matches!(
            tiles_for_spans(&[Span::new(0, 5, false), Span::new(4, 1, false)], 10),
            Err(KernelError::SpansOverlap { index: 1, .. })
        ));
    }

    #[test]
    fn grids_cover_the_work_within_limits() {
        assert_eq!(grid_1d(0), 1);
        assert_eq!(grid_1d(1), 1);
        assert_eq!(grid_1d(256), 1);
        assert_eq!(grid_1d(257), 2);
        assert_eq!(grid_1d(usize::MAX / 2), MAX_BLOCKS);
        assert_eq!(tile_grid(0), 1);
        assert_eq!(tile_grid(7), 7);
        assert_eq!(tile_grid(5 << 20), MAX_BLOCKS);
        assert!(BLOCK.is_power_of_two());
        assert!(SOURCE.contains(&format!("#define FSDP_BLOCK {BLOCK}")));
        for name in KERNEL_NAMES {
            assert!(SOURCE.contains(&format!("void {name}(")), "{name}");
        }
    }

    #[test]
    fn without_a_device_the_skip_path_is_taken() {
        match probe() {
            Probe::Available(n) => {
                assert!(n >= 1);
                assert!(device_or_skip("without_a_device_the_skip_path_is_taken"));
            }
            Probe::Unavailable(why) => {
                assert!(!why.is_empty());
                #[cfg(not(feature = "cuda"))]
                assert!(why.contains("cuda"), "{why}");
                assert!(!device_or_skip("without_a_device_the_skip_path_is_taken"));
            }
        }
    }
}
