//! [`FlatBuffer`]: an owned, dtype-tagged flat buffer on the CPU.

use crate::cast;
use crate::error::{check_len, KernelError};
use fsdp_types::{Bytes, DType, Numel};
use half::{bf16, f16};

/// An owned flat buffer of one of the training dtypes, on the CPU: a flat parameter (or shard of
/// one), its gradient, optimizer state, or a collective's send/receive buffer.
///
/// Length is in elements; [`FlatBuffer::size_bytes`] gives bytes
/// (`len * dtype.size_bytes()`).
#[derive(Debug, Clone, PartialEq)]
pub enum FlatBuffer {
    /// IEEE-754 binary32 elements.
    F32(Vec<f32>),
    /// bfloat16 elements.
    BF16(Vec<bf16>),
    /// IEEE-754 binary16 elements.
    F16(Vec<f16>),
    /// IEEE-754 binary64 elements.
    F64(Vec<f64>),
}

macro_rules! accessors {
    ($ref_fn:ident, $mut_fn:ident, $variant:ident, $t:ty, $dt:expr) => {
        #[doc = concat!("The elements as `&[", stringify!($t), "]`.\n\nErrors: [`KernelError::DTypeMismatch`] if the buffer is not ", stringify!($variant), ".")]
        pub fn $ref_fn(&self) -> Result<&[$t], KernelError> {
            match self {
                FlatBuffer::$variant(v) => Ok(v),
                other => Err(KernelError::DTypeMismatch {
                    what: "buffer",
                    expected: $dt,
                    actual: other.dtype(),
                }),
            }
        }
        #[doc = concat!("The elements as `&mut [", stringify!($t), "]`.\n\nErrors: [`KernelError::DTypeMismatch`] if the buffer is not ", stringify!($variant), ".")]
        pub fn $mut_fn(&mut self) -> Result<&mut [$t], KernelError> {
            match self {
                FlatBuffer::$variant(v) => Ok(v),
                other => Err(KernelError::DTypeMismatch {
                    what: "buffer",
                    expected: $dt,
                    actual: other.dtype(),
                }),
            }
        }
    };
}

impl FlatBuffer {
    /// A buffer of `n` elements of `dtype`, all `+0.0`. Allocates `n * dtype.size_bytes()` bytes.
    pub fn zeros(dtype: DType, n: usize) -> FlatBuffer {
        match dtype {
            DType::F32 => FlatBuffer::F32(vec![0.0; n]),
            DType::BF16 => FlatBuffer::BF16(vec![bf16::ZERO; n]),
            DType::F16 => FlatBuffer::F16(vec![f16::ZERO; n]),
            DType::F64 => FlatBuffer::F64(vec![0.0; n]),
        }
    }

    /// The element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            FlatBuffer::F32(_) => DType::F32,
            FlatBuffer::BF16(_) => DType::BF16,
            FlatBuffer::F16(_) => DType::F16,
            FlatBuffer::F64(_) => DType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            FlatBuffer::F32(v) => v.len(),
            FlatBuffer::BF16(v) => v.len(),
            FlatBuffer::F16(v) => v.len(),
            FlatBuffer::F64(v) => v.len(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of elements, as the [`Numel`] newtype.
    pub fn numel(&self) -> Numel {
        Numel(self.len() as u64)
    }

    /// Size of the elements in bytes: `len() * dtype().size_bytes()` (the `Vec`'s spare
    /// capacity is not counted).
    pub fn size_bytes(&self) -> Bytes {
        self.dtype().bytes(self.numel())
    }

    /// The raw little-endian bytes of the elements (`size_bytes()` bytes), e.g. for a
    /// safetensors file or a byte-level collective.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            FlatBuffer::F32(v) => bytemuck::cast_slice(v),
            FlatBuffer::BF16(v) => bytemuck::cast_slice(v),
            FlatBuffer::F16(v) => bytemuck::cast_slice(v),
            FlatBuffer::F64(v) => bytemuck::cast_slice(v),
        }
    }

    /// The raw bytes of the elements, writable (any bit pattern is a valid element).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            FlatBuffer::F32(v) => bytemuck::cast_slice_mut(v),
            FlatBuffer::BF16(v) => bytemuck::cast_slice_mut(v),
            FlatBuffer::F16(v) => bytemuck::cast_slice_mut(v),
            FlatBuffer::F64(v) => bytemuck::cast_slice_mut(v),
        }
    }

    /// A buffer of `dtype` holding little-endian element bytes `bytes`.
    ///
    /// Errors: [`KernelError::LengthMismatch`] if `bytes.len()` is not a multiple of the element
    /// size (lengths reported in bytes).
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> Result<FlatBuffer, KernelError> {
        let size = dtype.size_bytes() as usize;
        let n = bytes.len() / size;
        check_len("bytes (bytes)", n * size, bytes.len())?;
        let mut buf = FlatBuffer::zeros(dtype, n);
        buf.as_bytes_mut().copy_from_slice(bytes);
        Ok(buf)
    }

    accessors!(as_f32, as_f32_mut, F32, f32, DType::F32);
    accessors!(as_bf16, as_bf16_mut, BF16, bf16, DType::BF16);
    accessors!(as_f16, as_f16_mut, F16, f16, DType::F16);
    accessors!(as_f64, as_f64_mut, F64, f64, DType::F64);

    /// Sets every element to `+0.0` (all bits zero).
    pub fn fill_zero(&mut self) {
        self.as_bytes_mut().fill(0);
    }

    /// A new buffer of `dtype` with this buffer's values, rounded to nearest even when
    /// narrowing, exact when widening, copied bit for bit when `dtype` is the same (see
    /// [`crate::cast`]).
    pub fn cast(&self, dtype: DType) -> FlatBuffer {
        let mut out = FlatBuffer::zeros(dtype, self.len());
        self.cast_into(&mut out)
            .expect("same length by construction");
        out
    }

    /// Writes this buffer's values into `dst` (any dtype), rounding as [`FlatBuffer::cast`].
    ///
    /// Errors: [`KernelError::LengthMismatch`] if `dst.len() != self.len()`.
    pub fn cast_into(&self, dst: &mut FlatBuffer) -> Result<(), KernelError> {
        use FlatBuffer as B;
        match (self, dst) {
            (B::F32(s), B::F32(d)) => crate::elementwise::copy(d, s),
            (B::F32(s), B::BF16(d)) => cast::cast_f32_to_bf16(s, d),
            (B::F32(s), B::F16(d)) => cast::cast_f32_to_f16(s, d),
            (B::F32(s), B::F64(d)) => cast::cast_f32_to_f64(s, d),
            (B::BF16(s), B::F32(d)) => cast::cast_bf16_to_f32(s, d),
            (B::BF16(s), B::BF16(d)) => crate::elementwise::copy(d, s),
            (B::BF16(s), B::F16(d)) => cast::cast_bf16_to_f16(s, d),
            (B::BF16(s), B::F64(d)) => cast::cast_bf16_to_f64(s, d),
            (B::F16(s), B::F32(d)) => cast::cast_f16_to_f32(s, d),
            (B::F16(s), B::BF16(d)) => cast::cast_f16_to_bf16(s, d),
            (B::F16(s), B::F16(d)) => crate::elementwise::copy(d, s),
            (B::F16(s), B::F64(d)) => cast::cast_f16_to_f64(s, d),
            (B::F64(s), B::F32(d)) => cast::cast_f64_to_f32(s, d),
            (B::F64(s), B::BF16(d)) => cast::cast_f64_to_bf16(s, d),
            (B::F64(s), B::F16(d)) => cast::cast_f64_to_f16(s, d),
            (B::F64(s), B::F64(d)) => crate::elementwise::copy(d, s),
        }
    }

    /// Writes fp32 values `src` into this buffer, rounding to its dtype (round to nearest
    /// even; exact for F32 and F64). Used to fill a `param_dtype` / `reduce_dtype` buffer from
    /// fp32 master weights or gradients.
    ///
    /// Errors: [`KernelError::LengthMismatch`] if `src.len() != self.len()`.
    pub fn copy_from_f32(&mut self, src: &[f32]) -> Result<(), KernelError> {
        match self {
            FlatBuffer::F32(d) => crate::elementwise::copy(d, src),
            FlatBuffer::BF16(d) => cast::cast_f32_to_bf16(src, d),
            FlatBuffer::F16(d) => cast::cast_f32_to_f16(src, d),
            FlatBuffer::F64(d) => cast::cast_f32_to_f64(src, d),
        }
    }

    /// Writes this buffer's values into fp32 `dst` (exact from BF16/F16/F32, rounded to nearest
    /// even from F64).
    ///
    /// Errors: [`KernelError::LengthMismatch`] if `dst.len() != self.len()`.
    pub fn copy_to_f32(&self, dst: &mut [f32]) -> Result<(), KernelError> {
        match self {
            FlatBuffer::F32(s) => crate::elementwise::copy(dst, s),
            FlatBuffer::BF16(s) => cast::cast_bf16_to_f32(s, dst),
            FlatBuffer::F16(s) => cast::cast_f16_to_f32(s, dst),
            FlatBuffer::F64(s) => cast::cast_f64_to_f32(s, dst),
        }
    }

    /// [`FlatBuffer::copy_from_f32`] into the first `src.len()` elements (a reusable staging
    /// buffer longer than the shard it carries); the rest is not touched.
    ///
    /// Errors: [`KernelError::LengthMismatch`] if `src` is longer than the buffer.
    pub fn copy_from_f32_prefix(&mut self, src: &[f32]) -> Result<(), KernelError> {
        let n = src.len();
        check_fits("src", n, self.len())?;
        match self {
            FlatBuffer::F32(d) => crate::elementwise::copy(&mut d[..n], src),
            FlatBuffer::BF16(d) => cast::cast_f32_to_bf16(src, &mut d[..n]),
            FlatBuffer::F16(d) => cast::cast_f32_to_f16(src, &mut d[..n]),
            FlatBuffer::F64(d) => cast::cast_f32_to_f64(src, &mut d[..n]),
        }
    }

    /// `dst[i] += self[i]` with each element converted to fp32 first (exact from BF16/F16,
    /// rounded to nearest even from F64) and the sum rounded once: accumulates a `reduce_dtype`
    /// gradient into the fp32 gradient shard without a temporary buffer. `dst`: `self.len()`
    /// fp32 elements.
    ///
    /// Errors: [`KernelError::LengthMismatch`] (nothing is written).
    pub fn accumulate_into_f32(&self, dst: &mut [f32]) -> Result<(), KernelError> {
        check_len("dst", self.len(), dst.len())?;
        self.accumulate_prefix_into_f32(dst)
    }

    /// [`FlatBuffer::accumulate_into_f32`] of the first `dst.len()` elements (a reusable
    /// staging buffer longer than the shard it carries).
    ///
    /// Errors: [`KernelError::LengthMismatch`] if `dst` is longer than the buffer (nothing is
    /// written).
    pub fn accumulate_prefix_into_f32(&self, dst: &mut [f32]) -> Result<(), KernelError> {
        let n = dst.len();
        check_fits("dst", n, self.len())?;
        match self {
            FlatBuffer::F32(s) => crate::elementwise::accumulate(dst, &s[..n]),
            FlatBuffer::BF16(s) => {
                for (d, x) in dst.iter_mut().zip(s) {
                    *d += x.to_f32();
                }
                Ok(())
            }
            FlatBuffer::F16(s) => {
                for (d, x) in dst.iter_mut().zip(s) {
                    *d += x.to_f32();
                }
                Ok(())
            }
            FlatBuffer::F64(s) => {
                for (d, &x) in dst.iter_mut().zip(s) {
                    *d += x as f32;
                }
                Ok(())
            }
        }
    }
}

/// [`KernelError::LengthMismatch`] unless `n` elements fit a buffer of `len`.
fn check_fits(what: &'static str, n: usize, len: usize) -> Result<(), KernelError> {
    if n > len {
        return Err(KernelError::LengthMismatch {
            what,
            expected: len,
            actual: n,
        });
    }
    Ok(())
}

impl From<Vec<f32>> for FlatBuffer {
    fn from(v: Vec<f32>) -> Self {
        FlatBuffer::F32(v)
    }
}
impl From<Vec<bf16>> for FlatBuffer {
    fn from(v: Vec<bf16>) -> Self {
        FlatBuffer::BF16(v)
    }
}
impl From<Vec<f16>> for FlatBuffer {
    fn from(v: Vec<f16>) -> Self {
        FlatBuffer::F16(v)
    }
}
impl From<Vec<f64>> for FlatBuffer {
    fn from(v: Vec<f64>) -> Self {
        FlatBuffer::F64(v)
    }
}
