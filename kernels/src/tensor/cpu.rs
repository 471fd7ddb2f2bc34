//! CPU tensors: the locked storages as typed slices, handed to the slice kernels of this crate.

use super::lock::{self, Arg, Guard};
use crate::error::KernelError;
use candle_core::{CpuStorage, Storage};
use half::{bf16, f16};
use std::ops::Range;

/// A read-only window of a CPU storage.
pub(crate) enum Slice<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    F64(&'a [f64]),
}

/// A written window of a CPU storage.
pub(crate) enum SliceMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
    F64(&'a mut [f64]),
}

/// A copy of a read window (see `lock`'s snapshot rule).
enum Owned {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    F64(Vec<f64>),
}

/// One argument's window, read or written.
pub(crate) enum Piece<'a> {
    Ref(Slice<'a>),
    Mut(SliceMut<'a>),
}

fn internal(what: &'static str) -> KernelError {
    KernelError::UnsupportedDType {
        what,
        dtype: "a non-float or non-CPU storage".into(),
        supported: "f32, bf16, f16, f64 CPU storages",
    }
}

fn storage_ref(s: &Storage) -> Option<Slice<'_>> {
    match s {
        Storage::Cpu(CpuStorage::F32(v)) => Some(Slice::F32(v)),
        Storage::Cpu(CpuStorage::BF16(v)) => Some(Slice::BF16(v)),
        Storage::Cpu(CpuStorage::F16(v)) => Some(Slice::F16(v)),
        Storage::Cpu(CpuStorage::F64(v)) => Some(Slice::F64(v)),
        _ => None,
    }
}

fn storage_mut(s: &mut Storage) -> Option<SliceMut<'_>> {
    match s {
        Storage::Cpu(CpuStorage::F32(v)) => Some(SliceMut::F32(v)),
        Storage::Cpu(CpuStorage::BF16(v)) => Some(SliceMut::BF16(v)),
        Storage::Cpu(CpuStorage::F16(v)) => Some(SliceMut::F16(v)),
        Storage::Cpu(CpuStorage::F64(v)) => Some(SliceMut::F64(v)),
        _ => None,
    }
}

/// Cuts sorted, disjoint `cuts` out of `data`, in order.
fn split_mut<'a, T>(mut rest: &'a mut [T], cuts: &[Range<usize>]) -> Vec<&'a mut [T]> {
    let mut at = 0;
    let mut out = Vec::with_capacity(cuts.len());
    for c in cuts {
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(c.start - at);
        let (piece, tail) = tail.split_at_mut(c.len());
        out.push(piece);
        rest = tail;
        at = c.end;
    }
    out
}

impl<'a> Slice<'a> {
    fn sub(&self, r: Range<usize>) -> Slice<'a> {
        match self {
            Slice::F32(s) => Slice::F32(&s[r]),
            Slice::BF16(s) => Slice::BF16(&s[r]),
            Slice::F16(s) => Slice::F16(&s[r]),
            Slice::F64(s) => Slice::F64(&s[r]),
        }
    }

    fn to_owned_copy(&self) -> Owned {
        match self {
            Slice::F32(s) => Owned::F32(s.to_vec()),
            Slice::BF16(s) => Owned::BF16(s.to_vec()),
            Slice::F16(s) => Owned::F16(s.to_vec()),
            Slice::F64(s) => Owned::F64(s.to_vec()),
        }
    }
}

impl Owned {
    fn view(&self) -> Slice<'_> {
        match self {
            Owned::F32(v) => Slice::F32(v),
            Owned::BF16(v) => Slice::BF16(v),
            Owned::F16(v) => Slice::F16(v),
            Owned::F64(v) => Slice::F64(v),
        }
    }
}

impl<'a> SliceMut<'a> {
    fn split(self, cuts: &[Range<usize>]) -> Vec<SliceMut<'a>> {
        match self {
            SliceMut::F32(s) => split_mut(s, cuts).into_iter().map(SliceMut::F32).collect(),
            SliceMut::BF16(s) => split_mut(s, cuts).into_iter().map(SliceMut::BF16).collect(),
            SliceMut::F16(s) => split_mut(s, cuts).into_iter().map(SliceMut::F16).collect(),
            SliceMut::F64(s) => split_mut(s, cuts).into_iter().map(SliceMut::F64).collect(),
        }
    }

    fn empty_like(&self) -> SliceMut<'a> {
        match self {
            SliceMut::F32(_) => SliceMut::F32(&mut []),
            SliceMut::BF16(_) => SliceMut::BF16(&mut []),
            SliceMut::F16(_) => SliceMut::F16(&mut []),
            SliceMut::F64(_) => SliceMut::F64(&mut []),
        }
    }

    fn into_ref(self) -> Slice<'a> {
        match self {
            SliceMut::F32(s) => Slice::F32(s),
            SliceMut::BF16(s) => Slice::BF16(s),
            SliceMut::F16(s) => Slice::F16(s),
            SliceMut::F64(s) => Slice::F64(s),
        }
    }
}

impl<'a> Piece<'a> {
    /// The window, read-only (a written window reborrowed).
    pub fn slice(&self) -> Slice<'_> {
        match self {
            Piece::Ref(s) => s.sub(0..len_of(s)),
            Piece::Mut(m) => match m {
                SliceMut::F32(s) => Slice::F32(s),
                SliceMut::BF16(s) => Slice::BF16(s),
                SliceMut::F16(s) => Slice::F16(s),
                SliceMut::F64(s) => Slice::F64(s),
            },
        }
    }

    /// The written window.
    pub fn into_mut(self, what: &'static str) -> Result<SliceMut<'a>, KernelError> {
        match self {
            Piece::Mut(m) => Ok(m),
            Piece::Ref(_) => Err(internal(what)),
        }
    }

    /// The window as f32, read-only.
    pub fn f32(&self, what: &'static str) -> Result<&[f32], KernelError> {
        match self.slice() {
            Slice::F32(s) => Ok(s),
            _ => Err(internal(what)),
        }
    }

    /// The written window as f32.
    pub fn f32_mut(self, what: &'static str) -> Result<&'a mut [f32], KernelError> {
        match self.into_mut(what)? {
            SliceMut::F32(s) => Ok(s),
            _ => Err(internal(what)),
        }
    }
}

fn len_of(s: &Slice<'_>) -> usize {
    match s {
        Slice::F32(s) => s.len(),
        Slice::BF16(s) => s.len(),
        Slice::F16(s) => s.len(),
        Slice::F64(s) => s.len(),
    }
}

/// Locks the storages of `args` (see `lock`) and calls `f` with one [`Piece`] per argument, in
/// argument order: written arguments as [`Piece::Mut`], read ones as [`Piece::Ref`] (a copy when
/// they overlap another window of a written storage). The locks are released when `f` returns.
///
/// Errors: those of [`lock::plan`], and `f`'s.
pub(crate) fn with_pieces<R>(
    args: &[Arg<'_>],
    f: impl FnOnce(Vec<Piece<'_>>) -> Result<R, KernelError>,
) -> Result<R, KernelError> {
    let plan = lock::plan(args)?;
    let mut guards = lock::acquire(args, &plan);
    let mut snapshots: Vec<Option<Owned>> = (0..args.len()).map(|_| None).collect();
    for (i, p) in plan.placed.iter().enumerate() {
        if p.snapshot {
            let whole = storage_ref(guards[p.group].storage()).ok_or(internal(args[i].what))?;
            snapshots[i] = Some(whole.sub(p.range.clone()).to_owned_copy());
        }
    }
    let mut pieces: Vec<Option<Piece<'_>>> = (0..args.len()).map(|_| None).collect();
    for (g, guard) in guards.iter_mut().enumerate() {
        let members = &plan.groups[g].members;
        let first = args[members[0]].what;
        match guard {
            Guard::Read(s) => {
                let whole = storage_ref(s).ok_or(internal(first))?;
                for &i in members {
                    pieces[i] = Some(Piece::Ref(whole.sub(plan.placed[i].range.clone())));
                }
            }
            Guard::Write(s) => {
                let whole = storage_mut(s).ok_or(internal(first))?;
                let empty = whole.empty_like();
                for &i in members {
                    if plan.placed[i].range.is_empty() && !plan.placed[i].snapshot {
                        let e = empty.empty_like();
                        pieces[i] = Some(if args[i].write {
                            Piece::Mut(e)
                        } else {
                            Piece::Ref(e.into_ref())
                        });
                    }
                }
                let order = lock::split_order(&plan, g);
                let cuts: Vec<Range<usize>> = order
                    .iter()
                    .map(|&i| plan.placed[i].range.clone())
                    .collect();
                for (&i, part) in order.iter().zip(whole.split(&cuts)) {
                    pieces[i] = Some(if args[i].write {
                        Piece::Mut(part)
                    } else {
                        Piece::Ref(part.into_ref())
                    });
                }
            }
        }
    }
    for (i, s) in snapshots.iter().enumerate() {
        if let Some(s) = s {
            pieces[i] = Some(Piece::Ref(s.view()));
        }
    }
    let pieces = pieces
        .into_iter()
        .zip(args)
        .map(|(p, a)| p.ok_or(internal(a.what)))
        .collect::<Result<Vec<_>, _>>()?;
    f(pieces)
}
