//! Storage locking for the tensor kernels: which storages one call touches, in which mode, in
//! which order, and which element windows of them — device-agnostic (CPU and CUDA share it).
//!
//! candle keeps a tensor's storage behind a `parking_lot::RwLock` shared by every view of it (a
//! `narrow`, a `reshape`). parking_lot's locks are not reentrant: a thread that holds the write
//! lock and asks for a read lock of the same storage (e.g. `accumulate(t, t)`, or two narrows of
//! one buffer) waits for itself forever. So a call first finds each argument's storage identity
//! (the address of the `Storage` inside candle's `Arc<RwLock<Storage>>`, read under a lock that
//! is released at once), groups the arguments by storage, and then takes ONE lock per storage —
//! the write lock when any argument in it is written, else the read lock — in increasing address
//! order, so two calls on different threads never wait for each other in a cycle.
//!
//! Inside one storage the argument windows (`[start, start + len)` in storage elements) must not
//! let a write overlap another write ([`KernelError::AliasedBuffers`]); a read window that
//! overlaps any other window is copied first (a snapshot: the read sees the values from before
//! the call, like `memmove`), every other window is split out of the storage disjointly.

use crate::error::KernelError;
use candle_core::{Storage, StorageMutRef, StorageRef, Tensor};
use std::ops::Range;

/// One tensor argument of a kernel call.
pub(crate) struct Arg<'t> {
    /// The tensor (contiguous: checked by the caller).
    pub t: &'t Tensor,
    /// The argument's name, for errors.
    pub what: &'static str,
    /// Whether the call writes it.
    pub write: bool,
    /// The window of the tensor's elements the call touches: `(offset, len)` in elements from
    /// the tensor's first element.
    pub window: (usize, usize),
}

impl<'t> Arg<'t> {
    /// All elements of `t`, read.
    pub fn read(t: &'t Tensor, what: &'static str) -> Arg<'t> {
        Arg {
            t,
            what,
            write: false,
            window: (0, t.elem_count()),
        }
    }

    /// All elements of `t`, written.
    pub fn write(t: &'t Tensor, what: &'static str) -> Arg<'t> {
        Arg {
            t,
            what,
            write: true,
            window: (0, t.elem_count()),
        }
    }

    /// Elements `[offset, offset + len)` of `t`, written.
    pub fn write_window(t: &'t Tensor, what: &'static str, offset: usize, len: usize) -> Arg<'t> {
        Arg {
            t,
            what,
            write: true,
            window: (offset, len),
        }
    }
}

/// Where one argument lies.
pub(crate) struct Placed {
    /// Its window in storage elements.
    pub range: Range<usize>,
    /// Index of its storage in [`Plan::groups`].
    pub group: usize,
    /// Read through a copy taken before anything is written (overlaps another window).
    pub snapshot: bool,
}

/// One storage and the arguments in it.
pub(crate) struct Group {
    /// Whether any argument in it is written (then the write lock is taken).
    pub write: bool,
    /// Argument indices, in argument order.
    pub members: Vec<usize>,
}

/// The locking plan of one call.
pub(crate) struct Plan {
    /// Per argument, in argument order.
    pub placed: Vec<Placed>,
    /// Per storage, in increasing key order (the lock order).
    pub groups: Vec<Group>,
}

/// The identity of `t`'s storage: equal for every tensor sharing it (views, clones of the
/// handle), different for distinct storages alive at the same time. Takes and releases the read
/// lock (must not be called while this thread holds a lock on that storage).
pub(crate) fn storage_key(t: &Tensor) -> usize {
    let (guard, _) = t.storage_and_layout();
    let s: &Storage = &guard;
    std::ptr::from_ref(s) as usize
}

fn overlap(a: &Range<usize>, b: &Range<usize>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// Groups `args` by storage and checks their windows (see the module notes).
///
/// Errors: [`KernelError::NotContiguous`] (an argument the caller did not check),
/// [`KernelError::OffsetOutOfRange`] (a window past the tensor's end),
/// [`KernelError::AliasedBuffers`] (two written windows overlap).
pub(crate) fn plan(args: &[Arg<'_>]) -> Result<Plan, KernelError> {
    let mut placed = Vec::with_capacity(args.len());
    let mut keys = Vec::with_capacity(args.len());
    for a in args {
        let layout = a.t.layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(KernelError::NotContiguous {
                what: a.what,
                shape: a.t.dims().to_vec(),
                stride: a.t.stride().to_vec(),
            });
        };
        let (off, len) = a.window;
        if off.checked_add(len).is_none_or(|e| e > end - start) {
            return Err(KernelError::OffsetOutOfRange {
                what: a.what,
                offset: off,
                len,
                buffer_len: end - start,
            });
        }
        keys.push(storage_key(a.t));
        placed.push(Placed {
            range: start + off..start + off + len,
            group: usize::MAX,
            snapshot: false,
        });
    }
    let mut order: Vec<usize> = keys.clone();
    order.sort_unstable();
    order.dedup();
    let mut groups: Vec<Group> = order
        .iter()
        .map(|_| Group {
            write: false,
            members: Vec::new(),
        })
        .collect();
    for (i, key) in keys.iter().enumerate() {
        let g = order.binary_search(key).expect("every key is in `order`");
        placed[i].group = g;
        groups[g].members.push(i);
        groups[g].write |= args[i].write;
    }
    for g in &groups {
        for (x, &i) in g.members.iter().enumerate() {
            for &j in &g.members[x + 1..] {
                if !overlap(&placed[i].range, &placed[j].range) {
                    continue;
                }
                if args[i].write && args[j].write {
                    return Err(KernelError::AliasedBuffers {
                        first: args[i].what,
                        first_start: placed[i].range.start,
                        first_end: placed[i].range.end,
                        second: args[j].what,
                        second_start: placed[j].range.start,
                        second_end: placed[j].range.end,
                    });
                }
                // A read overlapping anything in a written storage is read from a copy.
                if g.write {
                    if !args[i].write {
                        placed[i].snapshot = true;
                    }
                    if !args[j].write {
                        placed[j].snapshot = true;
                    }
                }
            }
        }
    }
    Ok(Plan { placed, groups })
}

/// A held storage lock.
pub(crate) enum Guard<'t> {
    /// Shared (no argument in this storage is written).
    Read(StorageRef<'t>),
    /// Exclusive.
    Write(StorageMutRef<'t>),
}

impl Guard<'_> {
    /// The storage, read-only.
    pub fn storage(&self) -> &Storage {
        match self {
            Guard::Read(g) => g,
            Guard::Write(g) => g,
        }
    }
}

/// Takes the locks of `plan`, one per storage, in increasing storage-address order.
pub(crate) fn acquire<'t>(args: &[Arg<'t>], plan: &Plan) -> Vec<Guard<'t>> {
    plan.groups
        .iter()
        .map(|g| {
            let t = args[g.members[0]].t;
            if g.write {
                Guard::Write(t.storage_mut_and_layout().0)
            } else {
                Guard::Read(t.storage_and_layout().0)
            }
        })
        .collect()
}

/// For a written storage: the non-snapshot members sorted by window start (pairwise disjoint
/// by [`plan`]'s rules, and non-empty windows only: empty ones are given empty slices).
pub(crate) fn split_order(plan: &Plan, group: usize) -> Vec<usize> {
    let mut m: Vec<usize> = plan.groups[group]
        .members
        .iter()
        .copied()
        .filter(|&i| !plan.placed[i].snapshot && !plan.placed[i].range.is_empty())
        .collect();
    m.sort_by_key(|&i| plan.placed[i].range.start);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn buf(n: usize) -> Tensor {
        Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn one_group_per_storage_in_address_order_with_windows_in_storage_elements() {
        let (a, b) = (buf(100), buf(50));
        let (a1, a2) = (a.narrow(0, 10, 20).unwrap(), a.narrow(0, 40, 30).unwrap());
        let args = [
            Arg::write(&a1, "a1"),
            Arg::read(&b, "b"),
            Arg::write_window(&a2, "a2", 5, 10),
        ];
        let plan = plan(&args).unwrap();
        assert_eq!(plan.groups.len(), 2);
        let keys: Vec<usize> = plan
            .groups
            .iter()
            .map(|g| storage_key(args[g.members[0]].t))
            .collect();
        assert!(keys[0] < keys[1], "lock order is increasing address");
        let ga = plan.placed[0].group;
        assert_eq!(plan.placed[2].group, ga);
        assert_ne!(plan.placed[1].group, ga);
        assert_eq!(plan.groups[ga].members, vec![0, 2]);
        assert!(plan.groups[ga].write);
        assert!(!plan.groups[plan.placed[1].group].write);
        assert_eq!(plan.placed[0].range, 10..30);
        assert_eq!(plan.placed[2].range, 45..55);
        assert_eq!(plan.placed[1].range, 0..50);
        assert!(plan.placed.iter().all(|p| !p.snapshot));
        assert_eq!(split_order(&plan, ga), vec![0, 2]);
        // The locks can be taken (one per storage: no self-deadlock) and released.
        let guards = acquire(&args, &plan);
        assert_eq!(guards.len(), 2);
        assert!(matches!(guards[ga], Guard::Write(_)));
    }

    #[test]
    fn overlapping_reads_of_a_written_storage_are_snapshots_overlapping_writes_are_errors() {
        let a = buf(100);
        let (w, r) = (a.narrow(0, 0, 60).unwrap(), a.narrow(0, 50, 50).unwrap());
        let args = [Arg::write(&w, "dst"), Arg::read(&r, "src")];
        let p = plan(&args).unwrap();
        assert_eq!(p.groups.len(), 1);
        assert!(!p.placed[0].snapshot && p.placed[1].snapshot);
        assert_eq!(split_order(&p, 0), vec![0]);
        // Same tensor read and written.
        let args = [Arg::write(&a, "dst"), Arg::read(&a, "src")];
        assert!(plan(&args).unwrap().placed[1].snapshot);
        // Reads only: shared, no snapshot even when overlapping.
        let args = [Arg::read(&w, "x"), Arg::read(&r, "y")];
        let p = plan(&args).unwrap();
        assert!(!p.groups[0].write && p.placed.iter().all(|x| !x.snapshot));
        // Two overlapping writes.
        let args = [Arg::write(&w, "param"), Arg::write(&r, "exp_avg")];
        assert_eq!(
            plan(&args).err(),
            Some(KernelError::AliasedBuffers {
                first: "param",
                first_start: 0,
                first_end: 60,
                second: "exp_avg",
                second_start: 50,
                second_end: 100
            })
        );
        // Empty windows overlap nothing.
        let e = a.narrow(0, 10, 0).unwrap();
        let args = [Arg::write(&w, "param"), Arg::write(&e, "exp_avg")];
        let p = plan(&args).unwrap();
        assert_eq!(split_order(&p, 0), vec![0]);
        // A window past the tensor's end.
        let args = [Arg::write_window(&w, "dst", 55, 6)];
        assert!(matches!(
            plan(&args),
            Err(KernelError::OffsetOutOfRange {
                offset: 55,
                len: 6,
                buffer_len: 60,
                ..
            })
        ));
    }
}
