//! A checkpoint save that fails on a real write error: a file size limit (`RLIMIT_FSIZE`, the
//! write returns EFBIG) and a full file system (a small tmpfs mounted in a user and mount
//! namespace, when this machine lets an unprivileged process create one). The failed save
//! leaves no temporary directory, `latest` keeps naming the previous checkpoint, which still
//! resumes exactly; `--on-save-error stop` exits 1 naming the error, the bytes the checkpoint
//! needs and the bytes free; `continue` trains on and exits 1 only when the final save fails.

use fsdp_checkpoints::{Checkpoint, StateKind, Verify};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

mod run_cli;
use run_cli::{fsdp, losses, rewind, tiny_train_args};

/// A tiny, fast run: tiny GPT, 2 ranks, 1 x 16 tokens per micro-batch, a save every 2 steps.
fn train_args(root: &Path, steps: u64) -> Vec<String> {
    tiny_train_args(root, steps, "2", 1, 2, 1)
}

/// Runs `fsdp args` with a file size limit of `limit` bytes (what `ulimit -f` sets).
fn fsdp_limited(args: &[String], limit: u64) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fsdp"));
    cmd.args(args);
    // SAFETY: setrlimit is async-signal-safe; the closure touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            let l = libc::rlimit {
                rlim_cur: limit as libc::rlim_t,
                rlim_max: limit as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &l) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Names in `root` that a save leaves while it runs (`.tmp-*`, `.trash-*`).
fn leftovers(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp-") || n.starts_with(".trash-"))
        .collect()
}

/// `latest`'s content, trimmed.
fn latest(root: &Path) -> String {
    std::fs::read_to_string(root.join("latest"))
        .unwrap()
        .trim()
        .to_string()
}

/// The sizes of the rank files of checkpoint `dir`, added.
fn rank_file_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("rank-"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// The size of the largest rank file of checkpoint `dir`.
fn largest_rank_file(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("rank-"))
        .map(|e| e.metadata().unwrap().len())
        .max()
        .unwrap()
}

/// The advice of a save that failed on the file size limit of 1 MiB: the limit and the
/// largest rank file by their bytes, how to raise the limit, and not to free space.
fn assert_file_size_advice(err: &str, largest: u64) {
    assert_eq!(
        number_after(err, "a rank file of "),
        Some(largest),
        "the largest rank file: {err}"
    );
    assert_eq!(
        number_after(err, "this process's file size limit is "),
        Some(1 << 20),
        "the limit: {err}"
    );
    assert!(
        err.contains("`ulimit -f unlimited`") && err.contains("maximum file size"),
        "how to raise it: {err}"
    );
    assert!(
        !err.contains("free space (") && !err.contains("free space on"),
        "no advice to free space against a file size limit: {err}"
    );
}

/// Every state buffer of the newest checkpoint, consolidated, as bits.
fn state_bits(root: &Path) -> (u64, Vec<u32>) {
    let ck = Checkpoint::open(root, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    let mut bits = Vec::new();
    for kind in StateKind::ALL {
        for t in ck.consolidate(kind).unwrap() {
            bits.extend(t.data.iter().map(|x| x.to_bits()));
        }
    }
    (ck.manifest().train.step, bits)
}

/// The number after `prefix` in `text` (digits and thousands commas), e.g. the bytes of
/// "need 10,714,088 bytes".
fn number_after(text: &str, prefix: &str) -> Option<u64> {
    let at = text.find(prefix)? + prefix.len();
    let digits: String = text[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == ',')
        .filter(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// A file size limit below a rank file's size: the save of step 4 fails with EFBIG.
#[test]
fn a_save_past_the_file_size_limit_stops_or_continues_and_keeps_latest() {
    let t = tempfile::tempdir().unwrap();
    // The uninterrupted run, 4 steps, all checkpoints kept; then put back to the state of a
    // run stopped after saving step 2, and resumed under a limit of 1 MiB per file.
    let root = t.path().join("ck");
    let mut first = train_args(&root, 4);
    let i = first.iter().position(|s| s == "--keep-last").unwrap();
    first[i + 1] = "0".into();
    let (code, _, err) = fsdp(&first);
    assert_eq!(code, 0, "{err}");
    let full = state_bits(&root);
    assert_eq!(full.0, 4);
    rewind(&root, 2);
    let needed = rank_file_bytes(&root.join("step-00000002"));
    assert!(
        needed > 2 << 20,
        "each rank file is above the limit: {needed}"
    );
    let mut resume = train_args(&root, 4);
    resume.push("--resume".into());
    let (code, out, err) = fsdp_limited(&resume, 1 << 20);
    assert_eq!(code, 1, "a failed save stops the run with exit 1: {err}");
    assert!(
        err.contains("checkpoint of step 4") && err.contains("failed to write"),
        "{err}"
    );
    assert!(
        err.contains("File too large"),
        "the OS error is named: {err}"
    );
    assert_file_size_advice(&err, largest_rank_file(&root.join("step-00000002")));
    assert!(
        err.contains(".tmp-step-00000004/rank-0000"),
        "the path: {err}"
    );
    assert_eq!(
        number_after(&err, "its rank files need "),
        Some(needed),
        "the bytes the checkpoint needs: {err}"
    );
    assert!(
        number_after(&err, "MiB), ").is_some() && err.contains("are free"),
        "{err}"
    );
    assert!(
        err.contains("--on-save-error continue"),
        "the alternative: {err}"
    );
    assert_eq!(
        losses(&out).iter().map(|l| l.0).collect::<Vec<_>>(),
        vec![3],
        "the run stopped at the failed save of step 4 (step 4's line comes after its save)"
    );
    assert!(leftovers(&root).is_empty(), "{:?}", leftovers(&root));
    assert_eq!(latest(&root), "step-00000002");
    assert_eq!(fsdp_checkpoints::list_checkpoints(&root).unwrap().len(), 1);

    // Under `continue` the run trains on past the failed save of step 4, and the failed
    // final save (step 6) exits 1.
    let mut cont = train_args(&root, 6);
    cont.extend([
        "--resume".into(),
        "--on-save-error".into(),
        "continue".into(),
    ]);
    let (code, out, err) = fsdp_limited(&cont, 1 << 20);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("warning: checkpoint of step 4") && err.contains("training continues"),
        "{err}"
    );
    assert!(err.contains("the next save is due at step 6"), "{err}");
    assert!(
        err.contains("checkpoint of step 6") && err.contains("final state of step 6 is not saved"),
        "{err}"
    );
    assert_eq!(
        losses(&out).iter().map(|l| l.0).collect::<Vec<_>>(),
        vec![3, 4, 5],
        "steps after the failed save of step 4 trained"
    );
    assert!(leftovers(&root).is_empty(), "{:?}", leftovers(&root));
    assert_eq!(latest(&root), "step-00000002");

    // The checkpoint `latest` names still resumes, exactly.
    let (code, _, err) = fsdp(&resume);
    assert_eq!(code, 0, "{err}");
    assert!(
        state_bits(&root) == full,
        "the resumed run's step-4 state equals the uninterrupted run's, bit for bit"
    );
}

/// An asynchronous save fails the same way: its writer thread hits the limit, every rank
/// agrees at the next step boundary (here the final save, which is waited for), the temporary
/// directory is removed and `latest` still names step 2.
#[test]
fn an_async_save_past_the_file_size_limit_fails_like_a_synchronous_one() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let (code, _, err) = fsdp(&train_args(&root, 2));
    assert_eq!(code, 0, "{err}");
    let needed = rank_file_bytes(&root.join("step-00000002"));
    let mut resume = train_args(&root, 5);
    resume.extend(["--resume".into(), "--ckpt-async".into()]);
    let (code, out, err) = fsdp_limited(&resume, 1 << 20);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("checkpoint of step 4") && err.contains("failed to write"),
        "{err}"
    );
    assert!(err.contains("File too large"), "{err}");
    assert_file_size_advice(&err, largest_rank_file(&root.join("step-00000002")));
    assert_eq!(
        number_after(&err, "its rank files need "),
        Some(needed),
        "{err}"
    );
    // The failed save of step 4 is found at step 5's boundary at the latest.
    assert!(losses(&out).iter().all(|l| l.0 <= 5), "{out}");
    assert!(leftovers(&root).is_empty(), "{:?}", leftovers(&root));
    assert_eq!(latest(&root), "step-00000002");
}

/// `unshare -rm` creates a user and mount namespace here (where it cannot, the test says why
/// and passes, unless `FSDP_REQUIRE_UNSHARE=1`).
fn namespaces() -> bool {
    let ok = Command::new("unshare")
        .args(["-rm", "true"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            !std::env::var("FSDP_REQUIRE_UNSHARE").is_ok_and(|v| v == "1"),
            "FSDP_REQUIRE_UNSHARE=1 but `unshare -rm true` fails: no unprivileged user and \
             mount namespaces here"
        );
        println!(
            "skipped: `unshare -rm true` fails (no unprivileged user and mount namespaces), so \
             no small tmpfs can be mounted"
        );
    }
    ok
}

/// A file system that fills up: the checkpoint of step 2 fits a 16 MiB tmpfs, the one of
/// step 4 does not (the older one is pruned only after the new one is complete).
#[test]
fn a_save_into_a_full_file_system_leaves_no_temporary_directory() {
    if !namespaces() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let mnt = t.path().join("mnt");
    let copy = t.path().join("copy");
    std::fs::create_dir_all(&mnt).unwrap();
    let root = mnt.join("ck");
    let args: Vec<String> = train_args(&root, 4)
        .into_iter()
        .map(|a| format!("'{a}'"))
        .collect();
    // The tmpfs lives as long as the namespace: copy what the run left before leaving it.
    let script = format!(
        "mount -t tmpfs -o size=16m tmpfs '{mnt}' || exit 90; '{bin}' {args} 2>'{log}'; rc=$?; \
         cp -a '{root}' '{copy}'; exit $rc",
        mnt = mnt.display(),
        bin = env!("CARGO_BIN_EXE_fsdp"),
        args = args.join(" "),
        log = t.path().join("err.log").display(),
        root = root.display(),
        copy = copy.display(),
    );
    let out = Command::new("unshare")
        .args(["-rm", "sh", "-c", &script])
        .output()
        .unwrap();
    let err = std::fs::read_to_string(t.path().join("err.log")).unwrap_or_default();
    assert_ne!(out.status.code(), Some(90), "mount failed: {:?}", out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("checkpoint of step 4") && err.contains("No space left on device"),
        "{err}"
    );
    assert!(
        err.contains("free space on that file system") && err.contains("another --ckpt-dir"),
        "the advice of a full file system: {err}"
    );
    let needed = rank_file_bytes(&copy.join("step-00000002"));
    assert_eq!(
        number_after(&err, "its rank files need "),
        Some(needed),
        "{err}"
    );
    let free_at = err.find("MiB), ").expect("free bytes named") + "MiB), ".len();
    let free = number_after(&err[free_at..], "").expect("free bytes named");
    assert!(
        free < needed,
        "the free bytes named are fewer than needed: {err}"
    );
    assert!(leftovers(&copy).is_empty(), "{:?}", leftovers(&copy));
    assert_eq!(latest(&copy), "step-00000002");
    // Step 2 resumes (outside the namespace, on the copy) and trains to step 4.
    let mut resume = train_args(&copy, 4);
    resume.push("--resume".into());
    let (code, _, err) = fsdp(&resume);
    assert_eq!(code, 0, "{err}");
    assert_eq!(state_bits(&copy).0, 4);
}
