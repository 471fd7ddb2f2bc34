//! dtype-tagged buffers that collectives read and write.
//!
//! A collective sees a flat run of elements of one [`DType`]: borrowed ([`Buf`], [`BufMut`]) for
//! the synchronous calls, owned ([`OwnedBuf`]) for the started ones, whose buffers must outlive
//! the call that issued them.

use fsdp_types::{DType, Numel};
use half::{bf16, f16};

/// A borrowed, read-only run of elements of one dtype (the send side of a collective).
#[derive(Debug, Clone, Copy)]
pub enum Buf<'a> {
    /// IEEE binary32 elements.
    F32(&'a [f32]),
    /// bfloat16 elements.
    BF16(&'a [bf16]),
    /// IEEE binary16 elements.
    F16(&'a [f16]),
    /// IEEE binary64 elements.
    F64(&'a [f64]),
}

/// A borrowed, writable run of elements of one dtype (the receive side, or an in-place buffer).
#[derive(Debug)]
pub enum BufMut<'a> {
    /// IEEE binary32 elements.
    F32(&'a mut [f32]),
    /// bfloat16 elements.
    BF16(&'a mut [bf16]),
    /// IEEE binary16 elements.
    F16(&'a mut [f16]),
    /// IEEE binary64 elements.
    F64(&'a mut [f64]),
}

/// An owned run of elements of one dtype, moved into a started collective and handed back by
/// [`crate::PendingOp::wait`].
#[derive(Debug, Clone, PartialEq)]
pub enum OwnedBuf {
    /// IEEE binary32 elements.
    F32(Vec<f32>),
    /// bfloat16 elements.
    BF16(Vec<bf16>),
    /// IEEE binary16 elements.
    F16(Vec<f16>),
    /// IEEE binary64 elements.
    F64(Vec<f64>),
}

macro_rules! dispatch {
    ($v:expr, $x:ident => $e:expr) => {
        match $v {
            Self::F32($x) => $e,
            Self::BF16($x) => $e,
            Self::F16($x) => $e,
            Self::F64($x) => $e,
        }
    };
}

impl Buf<'_> {
    /// The element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::BF16(_) => DType::BF16,
            Buf::F16(_) => DType::F16,
            Buf::F64(_) => DType::F64,
        }
    }
    /// Number of elements (not bytes).
    pub fn len(&self) -> usize {
        dispatch!(self, x => x.len())
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of elements as a [`Numel`].
    pub fn numel(&self) -> Numel {
        Numel(self.len() as u64)
    }
    /// Address of the first element (dangling but aligned when empty).
    pub(crate) fn as_ptr(&self) -> *const u8 {
        dispatch!(self, x => x.as_ptr() as *const u8)
    }
    /// Element `i` widened to f64 (exact for every dtype), for tests and diagnostics.
    ///
    /// Panics if `i >= len()`.
    pub fn get_f64(&self, i: usize) -> f64 {
        match self {
            Buf::F32(x) => x[i] as f64,
            Buf::BF16(x) => x[i].to_f64(),
            Buf::F16(x) => x[i].to_f64(),
            Buf::F64(x) => x[i],
        }
    }
    /// All elements widened to f64 (exact for every dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        (0..self.len()).map(|i| self.get_f64(i)).collect()
    }
}

impl BufMut<'_> {
    /// The element dtype.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::F32(_) => DType::F32,
            BufMut::BF16(_) => DType::BF16,
            BufMut::F16(_) => DType::F16,
            BufMut::F64(_) => DType::F64,
        }
    }
    /// Number of elements (not bytes).
    pub fn len(&self) -> usize {
        dispatch!(self, x => x.len())
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Number of elements as a [`Numel`].
    pub fn numel(&self) -> Numel {
        Numel(self.len() as u64)
    }
    /// A shorter-lived mutable view of the same elements.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        match self {
            BufMut::F32(x) => BufMut::F32(x),
            BufMut::BF16(x) => BufMut::BF16(x),
            BufMut::F16(x) => BufMut::F16(x),
            BufMut::F64(x) => BufMut::F64(x),
        }
    }
    /// A read-only view of the same elements.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::F32(x) => Buf::F32(x),
            BufMut::BF16(x) => Buf::BF16(x),
            BufMut::F16(x) => Buf::F16(x),
            BufMut::F64(x) => Buf::F64(x),
        }
    }
    /// Address of the first element (dangling but aligned when empty).
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        dispatch!(self, x => x.as_mut_ptr() as *mut u8)
    }
}

impl OwnedBuf {
    /// `numel` zeros of `dtype`.
    pub fn zeros(dtype: DType, numel: usize) -> OwnedBuf {
        match dtype {
            DType::F32 => OwnedBuf::F32(vec![0.0; numel]),
            DType::BF16 => OwnedBuf::BF16(vec![bf16::ZERO; numel]),
            DType::F16 => OwnedBuf::F16(vec![f16::ZERO; numel]),
            DType::F64 => OwnedBuf::F64(vec![0.0; numel]),
        }
    }
    /// `values` rounded (round-to-nearest-even) into `dtype`.
    pub fn from_f64(dtype: DType, values: &[f64]) -> OwnedBuf {
        match dtype {
            DType::F32 => OwnedBuf::F32(values.iter().map(|&v| v as f32).collect()),
            DType::BF16 => OwnedBuf::BF16(values.iter().map(|&v| bf16::from_f64(v)).collect()),
            DType::F16 => OwnedBuf::F16(values.iter().map(|&v| f16::from_f64(v)).collect()),
            DType::F64 => OwnedBuf::F64(values.to_vec()),
        }
    }
    /// The element dtype.
    pub fn dtype(&self) -> DType {
        self.as_buf().dtype()
    }
    /// Number of elements (not bytes).
    pub fn len(&self) -> usize {
        dispatch!(self, x => x.len())
    }
    /// True when the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A read-only borrowed view.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            OwnedBuf::F32(x) => Buf::F32(x),
            OwnedBuf::BF16(x) => Buf::BF16(x),
            OwnedBuf::F16(x) => Buf::F16(x),
            OwnedBuf::F64(x) => Buf::F64(x),
        }
    }
    /// A writable borrowed view.
    pub fn as_buf_mut(&mut self) -> BufMut<'_> {
        match self {
            OwnedBuf::F32(x) => BufMut::F32(x),
            OwnedBuf::BF16(x) => BufMut::BF16(x),
            OwnedBuf::F16(x) => BufMut::F16(x),
            OwnedBuf::F64(x) => BufMut::F64(x),
        }
    }
    /// All elements widened to f64 (exact for every dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.as_buf().to_f64_vec()
    }
}

/// Element types a collective can carry: f32, bf16, f16, f64.
///
/// Gives the [`DType`] tag and the conversions that let generic code build [`Buf`] / [`BufMut`] /
/// [`OwnedBuf`] from typed slices and vectors.
pub trait Element: Copy + Send + Sync + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
    /// Wraps a slice as a [`Buf`].
    fn buf(s: &[Self]) -> Buf<'_>;
    /// Wraps a mutable slice as a [`BufMut`].
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    /// Wraps a vector as an [`OwnedBuf`].
    fn owned(v: Vec<Self>) -> OwnedBuf;
    /// Unwraps an [`OwnedBuf`] of this dtype; `None` for another dtype.
    fn from_owned(b: OwnedBuf) -> Option<Vec<Self>>;
}

macro_rules! element {
    ($t:ty, $v:ident, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn buf(s: &[Self]) -> Buf<'_> {
                Buf::$v(s)
            }
            fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
                BufMut::$v(s)
            }
            fn owned(v: Vec<Self>) -> OwnedBuf {
                OwnedBuf::$v(v)
            }
            fn from_owned(b: OwnedBuf) -> Option<Vec<Self>> {
                match b {
                    OwnedBuf::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
        impl<'a> From<&'a [$t]> for Buf<'a> {
            fn from(s: &'a [$t]) -> Buf<'a> {
                Buf::$v(s)
            }
        }
        impl<'a> From<&'a Vec<$t>> for Buf<'a> {
            fn from(s: &'a Vec<$t>) -> Buf<'a> {
                Buf::$v(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for BufMut<'a> {
            fn from(s: &'a mut [$t]) -> BufMut<'a> {
                BufMut::$v(s)
            }
        }
        impl<'a> From<&'a mut Vec<$t>> for BufMut<'a> {
            fn from(s: &'a mut Vec<$t>) -> BufMut<'a> {
                BufMut::$v(s)
            }
        }
        impl From<Vec<$t>> for OwnedBuf {
            fn from(v: Vec<$t>) -> OwnedBuf {
                OwnedBuf::$v(v)
            }
        }
    };
}
element!(f32, F32, DType::F32);
element!(bf16, BF16, DType::BF16);
element!(f16, F16, DType::F16);
element!(f64, F64, DType::F64);
