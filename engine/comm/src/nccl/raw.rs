//! Thin, checked wrappers over NCCL's C API (cudarc's `nccl::sys`, NCCL 2.28 ABI): non-blocking
//! communicators, error text, and polling with a deadline.
//!
//! Communicators are created non-blocking (`ncclConfig_t.blocking = 0`), so no NCCL call blocks
//! the host: a call returns `ncclInProgress` and [`RawComm::settle`] polls
//! `ncclCommGetAsyncError` until it is done, failed, or the deadline passed — the pattern NCCL's
//! user guide gives for fault tolerance ("Fault Tolerance" / "Non-blocking communicators"). A
//! timed-out or failed communicator is aborted (`ncclCommAbort`), which releases every rank
//! blocked in it on this process.

use crate::error::CommError;
use cudarc::nccl::sys;
use std::ffi::CStr;
use std::time::{Duration, Instant};

/// NCCL's text for `code` (`ncclGetErrorString`) and, when a communicator is given, its last
/// detailed error (`ncclGetLastError`).
pub(crate) fn nccl_text(code: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> String {
    // SAFETY: both return pointers to static or per-communicator NUL-terminated strings.
    let base = unsafe {
        let p = sys::ncclGetErrorString(code);
        if p.is_null() {
            format!("{code:?}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    let last = comm
        .map(|c| unsafe {
            let p = sys::ncclGetLastError(c);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        })
        .unwrap_or_default();
    if last.is_empty() {
        format!("{base} ({code:?})")
    } else {
        format!("{base} ({code:?}): {last}")
    }
}

/// A CUDA driver error as [`CommError::Device`] with the driver's text.
pub(crate) fn cuda_error(rank: usize, call: &str, e: cudarc::driver::DriverError) -> CommError {
    let message = match e.error_string() {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => format!("CUresult {:?}", e.0),
    };
    CommError::Device {
        rank,
        library: "cuda",
        call: call.to_string(),
        message,
    }
}

/// A non-blocking NCCL communicator handle (one group instance).
#[derive(Debug)]
pub(crate) struct RawComm {
    pub(crate) comm: sys::ncclComm_t,
    /// World rank owning the handle (for messages).
    pub(crate) rank: usize,
    pub(crate) aborted: std::cell::Cell<bool>,
}

// SAFETY: an ncclComm_t may be used from any thread, one at a time (NCCL user guide, "Thread
// safety"); NcclComm uses each handle from one thread at a time (`&self` methods of a `Send`,
// not `Sync`, communicator).
unsafe impl Send for RawComm {}

/// `NCCL_CONFIG_INITIALIZER` of NCCL 2.28 with `blocking = 0`.
pub(crate) fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800, // NCCL_VERSION(2, 28, 0): the struct layout cudarc's nccl-02028 binds
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// Why a [`RawComm::settle`] did not succeed.
#[derive(Debug)]
pub(crate) enum Unsettled {
    /// NCCL reported an error (text included).
    Failed(String),
    /// The deadline passed with the call still in progress.
    TimedOut,
}

impl RawComm {
    /// `ncclCommInitRankConfig` (non-blocking) for `rank` of `nranks` with `id`, settled by
    /// `deadline`. The caller has bound the device context to this thread.
    pub(crate) fn init(
        rank: usize,
        nranks: usize,
        id: sys::ncclUniqueId,
        deadline: Instant,
    ) -> Result<RawComm, (String, Option<Unsettled>)> {
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = nonblocking_config();
        // SAFETY: out-pointer and config valid for the call.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, nranks as i32, id, rank as i32, &mut config)
        };
        let call = format!("ncclCommInitRankConfig(rank {rank} of {nranks})");
        let raw = RawComm {
            comm,
            rank,
            aborted: std::cell::Cell::new(false),
        };
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            let text = nccl_text(r, (!comm.is_null()).then_some(comm));
            if !comm.is_null() {
                raw.abort();
            }
            return Err((call, Some(Unsettled::Failed(text))));
        }
        match raw.settle(deadline) {
            Ok(()) => Ok(raw),
            Err(u) => {
                raw.abort();
                Err((call, Some(u)))
            }
        }
    }

    /// `ncclCommSplit(self, color, key)` (non-blocking), settled by `deadline`; collective over
    /// every rank of `self`.
    pub(crate) fn split(
        &self,
        color: i32,
        key: i32,
        deadline: Instant,
    ) -> Result<RawComm, (String, Unsettled)> {
        let mut child: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = nonblocking_config();
        // SAFETY: live parent communicator, valid out-pointer and config.
        let r = unsafe { sys::ncclCommSplit(self.comm, color, key, &mut child, &mut config) };
        let call = format!("ncclCommSplit(color {color}, key {key})");
        self.check(r)
            .map_err(|t| (call.clone(), Unsettled::Failed(t)))?;
        self.settle(deadline).map_err(|u| (call.clone(), u))?;
        let c = RawComm {
            comm: child,
            rank: self.rank,
            aborted: std::cell::Cell::new(false),
        };
        if child.is_null() {
            return Err((
                call,
                Unsettled::Failed("NCCL returned no communicator".into()),
            ));
        }
        match c.settle(deadline) {
            Ok(()) => Ok(c),
            Err(u) => {
                c.abort();
                Err((call, u))
            }
        }
    }

    /// `Ok` for success or in-progress, else NCCL's text.
    pub(crate) fn check(&self, r: sys::ncclResult_t) -> Result<(), String> {
        match r {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            e => Err(nccl_text(e, Some(self.comm))),
        }
    }

    /// The communicator's asynchronous state: `Ok(true)` done, `Ok(false)` in progress, `Err`
    /// NCCL's error text (a peer failed, a network error, ...).
    pub(crate) fn async_state(&self) -> Result<bool, String> {
        let mut st = sys::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator, valid out-pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut st) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(nccl_text(r, Some(self.comm)));
        }
        match st {
            sys::ncclResult_t::ncclSuccess => Ok(true),
            sys::ncclResult_t::ncclInProgress => Ok(false),
            e => Err(nccl_text(e, Some(self.comm))),
        }
    }

    /// Polls until the last call is no longer in progress (it is then enqueued on its stream),
    /// NCCL reports an error, or `deadline` passes.
    pub(crate) fn settle(&self, deadline: Instant) -> Result<(), Unsettled> {
        let mut pause = Duration::from_micros(20);
        loop {
            match self.async_state() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(t) => return Err(Unsettled::Failed(t)),
            }
            if Instant::now() >= deadline {
                return Err(Unsettled::TimedOut);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// `ncclCommAbort`: cancels outstanding operations and frees the communicator (once).
    pub(crate) fn abort(&self) {
        if !self.aborted.get() && !self.comm.is_null() {
            // SAFETY: live communicator, aborted once.
            unsafe {
                sys::ncclCommAbort(self.comm);
            }
            self.aborted.set(true);
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        self.abort();
    }
}

/// `ncclGroupStart` / `ncclGroupEnd` around `f` (for the grouped send/receive of the
/// rank-order reduction). Returns NCCL's text on failure.
pub(crate) fn grouped(
    comm: &RawComm,
    f: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    // SAFETY: plain calls; the group is always closed.
    let r = unsafe { sys::ncclGroupStart() };
    comm.check(r)?;
    let inner = f();
    let r = unsafe { sys::ncclGroupEnd() };
    inner?;
    comm.check(r)
}
