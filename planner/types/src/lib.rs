//! fsdp-types: the leaf vocabulary of fsdp-rs.
//!
//! One job: name the quantities every crate exchanges so that element counts and byte counts can
//! never be confused. [`Numel`] counts tensor elements, [`Bytes`] counts bytes; converting one into
//! the other always goes through a [`DType`].

#![warn(missing_docs)]

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Mul, Sub};
use std::str::FromStr;

/// Floating-point element types the engine stores, communicates and computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE-754 binary32, 4 bytes.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa), 2 bytes.
    BF16,
    /// IEEE-754 binary16, 2 bytes.
    F16,
    /// IEEE-754 binary64, 8 bytes.
    F64,
}

impl DType {
    /// Bytes per element: 4 (f32), 2 (bf16, f16), 8 (f64).
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F64 => 8,
        }
    }

    /// Bytes taken by `n` elements of this dtype.
    pub const fn bytes(self, n: Numel) -> Bytes {
        Bytes(n.0 * self.size_bytes())
    }

    /// The lowercase name used on the command line and in JSON (`f32`, `bf16`, `f16`, `f64`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F64 => "f64",
        }
    }

    /// Parses a safetensors dtype tag (`F32`, `BF16`, `F16`, `F64`). Other tags (integers,
    /// fp8) are not training dtypes and return `None`.
    pub fn from_safetensors(tag: &str) -> Option<DType> {
        match tag {
            "F32" => Some(DType::F32),
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            "F64" => Some(DType::F64),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error from parsing a [`DType`] or a [`Bytes`] quantity written by a user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The dtype name is not one of f32, bf16, f16, f64.
    #[error("unknown dtype `{0}` (expected one of: f32, bf16, f16, f64)")]
    DType(String),
    /// The byte size could not be read (e.g. `80GiB`, `512MB`, `1000000`).
    #[error("cannot read byte size `{0}` (examples: 80GiB, 40GB, 512MiB, 1048576)")]
    Bytes(String),
    /// The byte size is at least 2^64 bytes (16 EiB), more than a `u64` count holds.
    #[error("byte size `{0}` is too large (at most 18446744073709551615 bytes, 16 EiB)")]
    BytesTooLarge(String),
    /// A byte size with a minus sign, e.g. `-5GiB`.
    #[error("byte size `{0}` is negative (give a size of at least 1 byte, e.g. 80GiB)")]
    NegativeBytes(String),
    /// A plain byte count (no unit, or `B`) with a fractional part, e.g. `1.5`.
    #[error("byte size `{0}` is a fraction of a byte (give whole bytes, or a unit: 1.5GiB)")]
    FractionalBytes(String),
}

impl FromStr for DType {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "f64" | "fp64" | "float64" => Ok(DType::F64),
            _ => Err(ParseError::DType(s.to_string())),
        }
    }
}

/// A number of tensor elements (not bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Numel(pub u64);

/// A number of bytes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

macro_rules! count_ops {
    ($t:ident) => {
        impl Add for $t {
            type Output = $t;
            fn add(self, o: $t) -> $t {
                $t(self.0 + o.0)
            }
        }
        impl AddAssign for $t {
            fn add_assign(&mut self, o: $t) {
                self.0 += o.0;
            }
        }
        impl Sub for $t {
            type Output = $t;
            fn sub(self, o: $t) -> $t {
                $t(self.0 - o.0)
            }
        }
        impl Mul<u64> for $t {
            type Output = $t;
            fn mul(self, k: u64) -> $t {
                $t(self.0 * k)
            }
        }
        impl std::iter::Sum for $t {
            fn sum<I: Iterator<Item = $t>>(it: I) -> $t {
                $t(it.map(|x| x.0).sum())
            }
        }
        impl $t {
            /// The count as `usize` (panics only on 32-bit hosts for counts above 4 Gi).
            pub fn as_usize(self) -> usize {
                usize::try_from(self.0).expect("count exceeds usize")
            }
        }
    };
}
count_ops!(Numel);
count_ops!(Bytes);

impl fmt::Display for Numel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", group_thousands(self.0))
    }
}

impl fmt::Display for Bytes {
    /// Binary units: `1.50 GiB`, `512.00 MiB`, `17 B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut v = self.0 as f64 / 1024.0;
        let mut i = 0;
        while v >= 1024.0 && i + 1 < UNITS.len() {
            v /= 1024.0;
            i += 1;
        }
        write!(f, "{v:.2} {}", UNITS[i])
    }
}

impl FromStr for Bytes {
    type Err = ParseError;
    /// Reads `80GiB`, `80 GiB`, `40GB` (10^9), `512MiB`, `1.5TiB`, `1048576` (bytes).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.starts_with('-') {
            return Err(ParseError::NegativeBytes(s.to_string()));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let v: f64 = num.parse().map_err(|_| ParseError::Bytes(s.to_string()))?;
        let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "m" | "mb" => 1e6,
            "g" | "gb" => 1e9,
            "t" | "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => 1024.0 * 1024.0 * 1024.0,
            "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            _ => return Err(ParseError::Bytes(s.to_string())),
        };
        let b = v * mult;
        if !b.is_finite() || b < 0.0 {
            return Err(ParseError::Bytes(s.to_string()));
        }
        // 2^64 is exactly representable; every f64 below it converts without saturating.
        if b >= 18_446_744_073_709_551_616.0 {
            return Err(ParseError::BytesTooLarge(s.to_string()));
        }
        if mult == 1.0 && v.fract() != 0.0 {
            return Err(ParseError::FractionalBytes(s.to_string()));
        }
        Ok(Bytes(b.round() as u64))
    }
}

/// `1234567` -> `"1,234,567"`.
pub fn group_thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_parse() {
        assert_eq!("80GiB".parse::<Bytes>().unwrap(), Bytes(80 << 30));
        // Never saturates: 2^64 bytes and more are refused, just below is kept.
        for big in [
            "18446744073709551616",
            "99999999999999999999GiB",
            "16777216TiB",
        ] {
            assert_eq!(
                big.parse::<Bytes>(),
                Err(ParseError::BytesTooLarge(big.to_string()))
            );
        }
        assert_eq!(
            "16777215TiB".parse::<Bytes>().unwrap(),
            Bytes(16_777_215 << 40)
        );
        assert_eq!(
            "1.5".parse::<Bytes>(),
            Err(ParseError::FractionalBytes("1.5".into()))
        );
        assert_eq!("1.5KiB".parse::<Bytes>().unwrap(), Bytes(1536));
        assert_eq!("40GB".parse::<Bytes>().unwrap(), Bytes(40_000_000_000));
        assert_eq!("1024".parse::<Bytes>().unwrap(), Bytes(1024));
        assert!("lots".parse::<Bytes>().is_err());
        assert_eq!(
            "-5GiB".parse::<Bytes>(),
            Err(ParseError::NegativeBytes("-5GiB".into()))
        );
        assert_eq!(Bytes(3 << 29).to_string(), "1.50 GiB");
    }

    #[test]
    fn dtype_sizes() {
        assert_eq!(DType::BF16.bytes(Numel(10)), Bytes(20));
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!(group_thousands(124439808), "124,439,808");
    }
}
