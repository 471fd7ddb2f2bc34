//! Large copies of the thread backend: non-temporal (streaming) stores once a collective writes
//! more than fits its share of the last-level cache.
//!
//! glibc's `memcpy` streams (bypasses the cache with non-temporal stores, saving the
//! read-for-ownership of every destination line and the eviction of useful data) when one call
//! copies at least its `x86_non_temporal_threshold`, 3/4 of the per-core share of the
//! last-level cache. An all-gather copies its `W x n` bytes as `W` calls of `n` bytes, so
//! `memcpy` would judge each block alone and keep caching blocks of a receive buffer that as a
//! whole cannot stay in cache. The thread backend therefore decides once per collective, from
//! the bytes the rank writes in total, with the same threshold, and streams every block itself.
//! Reference: Intel 64 and IA-32 Architectures Optimization Reference Manual, "Non-temporal
//! stores" (streaming stores bypass the cache and avoid the read for ownership).

use std::path::Path;

/// 3/4 of this machine's per-core share of the last-level cache in bytes (glibc's
/// `x86_non_temporal_threshold` rule), read from Linux's
/// `/sys/devices/system/cpu/cpu0/cache/index*/{level,size,shared_cpu_list}`; `usize::MAX`
/// (never stream) when the cache cannot be read.
pub(crate) fn non_temporal_threshold() -> usize {
    threshold_from(Path::new("/sys/devices/system/cpu/cpu0/cache")).unwrap_or(usize::MAX)
}

fn threshold_from(dir: &Path) -> Option<usize> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let mut best: Option<(u32, usize, usize)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        let Some(level) = read(&p.join("level")).and_then(|s| s.trim().parse::<u32>().ok()) else {
            continue;
        };
        let Some(size) = read(&p.join("size")).and_then(|s| parse_size(&s)) else {
            continue;
        };
        let sharers = read(&p.join("shared_cpu_list"))
            .map(|s| count_cpus(&s))
            .unwrap_or(1)
            .max(1);
        if best.is_none_or(|(l, _, _)| level > l) {
            best = Some((level, size, sharers));
        }
    }
    let (_, size, sharers) = best?;
    Some(size / sharers * 3 / 4)
}

/// `"307200K"` -> 314572800; also `M`, `G` and plain bytes.
fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1usize << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        'G' | 'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
}

/// Number of CPUs in a Linux CPU list such as `"0-3,8,10-11"` (7).
fn count_cpus(list: &str) -> usize {
    list.trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('-') {
            Some((a, b)) => match (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                (Ok(a), Ok(b)) if b >= a => b - a + 1,
                _ => 1,
            },
            None => 1,
        })
        .sum()
}

/// Copies `bytes` bytes from `src` to `dst`; with `stream`, with non-temporal stores (x86-64:
/// whole 64-byte destination lines with `vmovntdq` (AVX2, 128 bytes an iteration, source
/// prefetched 1 KiB ahead) or SSE2 `movntdq` when AVX2 is absent, ordinary copies for the
/// unaligned head and the tail); elsewhere, or without `stream`, `ptr::copy_nonoverlapping`.
/// A run of streaming copies is closed by one [`fence`] (`sfence`) before another thread may
/// read the data (one fence per run, not per copy: each fence waits for the write-combining
/// buffers to drain).
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `bytes` bytes, the two ranges disjoint; the
/// caller calls [`fence`] before anyone else reads `dst`.
pub(crate) unsafe fn copy_unfenced(src: *const u8, dst: *mut u8, bytes: usize, stream: bool) {
    #[cfg(target_arch = "x86_64")]
    if stream && bytes >= 256 {
        if std::arch::is_x86_feature_detected!("avx2") {
            copy_streaming_avx2(src, dst, bytes);
        } else {
            copy_streaming_sse2(src, dst, bytes);
        }
        return;
    }
    let _ = stream;
    std::ptr::copy_nonoverlapping(src, dst, bytes);
}

/// Orders earlier non-temporal stores before later stores (`sfence` on x86-64, nothing
/// elsewhere, where [`copy_unfenced`] never streams).
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions (SSE, part of the x86-64 baseline).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// The unaligned head: bytes up to the first 64-byte boundary of `dst`, copied normally.
#[cfg(target_arch = "x86_64")]
unsafe fn head(src: *const u8, dst: *mut u8, bytes: usize) -> (*const u8, *mut u8, usize) {
    let head = dst.align_offset(64).min(bytes);
    std::ptr::copy_nonoverlapping(src, dst, head);
    (src.add(head), dst.add(head), bytes - head)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_streaming_avx2(src: *const u8, dst: *mut u8, bytes: usize) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_prefetch, _MM_HINT_T0,
    };
    let (mut s, mut d, mut left) = head(src, dst, bytes);
    while left >= 128 {
        // SAFETY: 128 readable bytes at `s`, 128 writable bytes at the 64-aligned `d`; a
        // prefetch of any address is harmless.
        _mm_prefetch::<_MM_HINT_T0>(s.wrapping_add(1024) as *const i8);
        let a = _mm256_loadu_si256(s as *const __m256i);
        let b = _mm256_loadu_si256(s.add(32) as *const __m256i);
        let c = _mm256_loadu_si256(s.add(64) as *const __m256i);
        let e = _mm256_loadu_si256(s.add(96) as *const __m256i);
        _mm256_stream_si256(d as *mut __m256i, a);
        _mm256_stream_si256(d.add(32) as *mut __m256i, b);
        _mm256_stream_si256(d.add(64) as *mut __m256i, c);
        _mm256_stream_si256(d.add(96) as *mut __m256i, e);
        s = s.add(128);
        d = d.add(128);
        left -= 128;
    }
    std::ptr::copy_nonoverlapping(s, d, left);
}

#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming_sse2(src: *const u8, dst: *mut u8, bytes: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let (mut s, mut d, mut left) = head(src, dst, bytes);
    while left >= 64 {
        // SAFETY: 64 readable bytes at `s`, 64 writable bytes at the 64-aligned `d`.
        let a = _mm_loadu_si128(s as *const __m128i);
        let b = _mm_loadu_si128(s.add(16) as *const __m128i);
        let c = _mm_loadu_si128(s.add(32) as *const __m128i);
        let e = _mm_loadu_si128(s.add(48) as *const __m128i);
        _mm_stream_si128(d as *mut __m128i, a);
        _mm_stream_si128(d.add(16) as *mut __m128i, b);
        _mm_stream_si128(d.add(32) as *mut __m128i, c);
        _mm_stream_si128(d.add(48) as *mut __m128i, e);
        s = s.add(64);
        d = d.add(64);
        left -= 64;
    }
    std::ptr::copy_nonoverlapping(s, d, left);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copy_is_exact_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for off_s in 0..5 {
            for off_d in [0usize, 1, 15, 16, 33, 63] {
                for len in [0usize, 1, 63, 64, 255, 256, 257, 1000, 4093] {
                    type CopyFn = unsafe fn(*const u8, *mut u8, usize);
                    let mut variants: Vec<(&str, CopyFn)> = vec![
                        ("dispatch", |s, d, n| unsafe {
                            copy_unfenced(s, d, n, true)
                        }),
                        ("plain", |s, d, n| unsafe { copy_unfenced(s, d, n, false) }),
                    ];
                    #[cfg(target_arch = "x86_64")]
                    {
                        variants.push(("sse2", copy_streaming_sse2));
                        if std::arch::is_x86_feature_detected!("avx2") {
                            variants
                                .push(("avx2", |s, d, n| unsafe { copy_streaming_avx2(s, d, n) }));
                        }
                    }
                    for (name, f) in variants {
                        let mut dst = vec![0xAAu8; 4200];
                        unsafe { f(src.as_ptr().add(off_s), dst.as_mut_ptr().add(off_d), len) };
                        fence();
                        let at = format!("{name}: src+{off_s} dst+{off_d} len {len}");
                        assert_eq!(&dst[off_d..off_d + len], &src[off_s..off_s + len], "{at}");
                        assert!(dst[..off_d].iter().all(|&x| x == 0xAA), "{at}");
                        assert!(dst[off_d + len..].iter().all(|&x| x == 0xAA), "{at}");
                    }
                }
            }
        }
    }

    #[test]
    fn cache_sizes_and_cpu_lists_parse() {
        assert_eq!(parse_size("307200K\n"), Some(307200 << 10));
        assert_eq!(parse_size("2M"), Some(2 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("x"), None);
        assert_eq!(count_cpus("0-3,8,10-11\n"), 7);
        assert_eq!(count_cpus("0"), 1);
    }

    #[test]
    fn threshold_is_three_quarters_of_the_per_core_llc_share() {
        let dir = std::env::temp_dir().join(format!("fsdp-comm-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (i, level, size, cpus) in [
            (0, "1", "48K", "0"),
            (2, "2", "2048K", "0"),
            (3, "3", "307200K", "0-1"),
        ] {
            let d = dir.join(format!("index{i}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("level"), level).unwrap();
            std::fs::write(d.join("size"), size).unwrap();
            std::fs::write(d.join("shared_cpu_list"), cpus).unwrap();
        }
        // 300 MiB shared by 2 CPUs: 150 MiB each, 3/4 of it.
        assert_eq!(threshold_from(&dir), Some((307200usize << 10) / 2 * 3 / 4));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(threshold_from(Path::new("/nonexistent/fsdp-comm")), None);
    }
}
