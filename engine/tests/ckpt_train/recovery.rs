//! Recovery as a long-running job needs it: a damaged newest checkpoint is named with the
//! newest intact one, `--resume-from latest-valid` continues from that one bit for bit like an
//! uninterrupted run, a step folder is refused as `--ckpt-dir`, and a resume that changes the
//! batch shape says which samples are skipped.

use super::{fsdp, losses, state_bits, train_args};
use std::path::Path;

fn set(args: &mut [String], flag: &str, v: &str) {
    let i = args.iter().position(|s| s == flag).unwrap();
    args[i + 1] = v.into();
}

fn flip_a_byte(dir: &Path) {
    let f = dir.join("rank-00001.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 100] ^= 0x10;
    std::fs::write(&f, b).unwrap();
}

#[test]
fn damaged_newest_checkpoint_falls_back_to_the_newest_intact_one_bitwise() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("r");
    let mut args = train_args(&root, 6, "2");
    set(&mut args, "--ckpt-every", "2");
    set(&mut args, "--keep-last", "0");
    let (code, out_a, err) = fsdp(&args);
    assert_eq!(code, 0, "{err}");
    let la = losses(&out_a);
    let uninterrupted = state_bits(&root);
    assert_eq!(uninterrupted.0, 6);
    let s6 = root.join("step-00000006");
    flip_a_byte(&s6);
    // Plain --resume names the damaged checkpoint and the intact one, and changes nothing.
    let mut resume = args.clone();
    resume.push("--resume".into());
    let (code, _, err) = fsdp(&resume);
    assert_eq!(code, 2, "{err}");
    for want in [
        format!("cannot resume from the newest checkpoint {}", s6.display()),
        "(`latest` names it)".to_string(),
        "rank-00001.safetensors: SHA-256 checksum mismatch".to_string(),
        format!(
            "the newest intact checkpoint is {} (step 4)",
            root.join("step-00000004").display()
        ),
        "--resume-from latest-valid (or --resume-from 4)".to_string(),
    ] {
        assert!(err.contains(&want), "missing `{want}` in {err}");
    }
    assert!(
        s6.join("manifest.json").is_file(),
        "the refusal touches nothing"
    );
    // --resume-from latest-valid: steps 5 and 6 again, exactly as the uninterrupted run.
    let mut valid = args.clone();
    valid.extend(["--resume-from".into(), "latest-valid".into()]);
    let (code, out_c, err) = fsdp(&valid);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!("warning: skipping {}", s6.display()))
            && err.contains("resuming from")
            && err.contains("step-00000004 (step 4"),
        "{err}"
    );
    assert_eq!(losses(&out_c), la[4..].to_vec(), "steps 5..6, bit for bit");
    assert_eq!(
        state_bits(&root),
        uninterrupted,
        "params and moments at step 6"
    );
    let aside = root.join("step-00000006.damaged");
    assert!(
        aside.join("manifest.json").is_file(),
        "the damaged one is kept aside"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("latest")).unwrap().trim(),
        "step-00000006"
    );
}

#[test]
fn incomplete_newest_and_step_folder_as_root_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("r");
    let mut args = train_args(&root, 3, "1");
    set(&mut args, "--keep-last", "0");
    assert_eq!(fsdp(&args).0, 0);
    // `latest` names step 3, whose manifest is gone.
    std::fs::remove_file(root.join("step-00000003/manifest.json")).unwrap();
    let mut resume = args.clone();
    resume.push("--resume".into());
    let (code, _, err) = fsdp(&resume);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("step-00000003 (`latest` names it): no manifest.json (incomplete or damaged)")
            && err.contains("the newest intact checkpoint is")
            && err.contains("step-00000002 (step 2)"),
        "{err}"
    );
    // A step folder as --ckpt-dir: refused, nothing written inside it.
    let step2 = root.join("step-00000002");
    let before = std::fs::read_dir(&step2).unwrap().count();
    let mut nested = train_args(&step2, 4, "1");
    nested.push("--resume".into());
    let (code, _, err) = fsdp(&nested);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("is a checkpoint (it holds manifest.json), not a checkpoint root")
            && err.contains(&format!(
                "use --ckpt-dir {} --resume-from 2",
                root.display()
            )),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&step2).unwrap().count(), before);
    // --resume-from a step that is not there lists the steps.
    let mut missing = args.clone();
    missing.extend(["--resume-from".into(), "7".into()]);
    let (code, _, err) = fsdp(&missing);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("has no checkpoint of step 7 (steps there: 1, 2, 3)"),
        "{err}"
    );
}

#[test]
fn resume_with_another_batch_shape_or_data_says_what_changes() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("r");
    let args = train_args(&root, 2, "2");
    assert_eq!(fsdp(&args).0, 0);
    // 2 steps x 2 ranks x 1 sequence consumed; now 2 ranks x 3: the run continues at 4.
    let mut more = train_args(&root, 3, "2");
    set(&mut more, "--micro-batch", "3");
    let data = t.path().join("other.txt");
    std::fs::write(
        &data,
        "To be, or not to be, that is the question.\n".repeat(200),
    )
    .unwrap();
    more.extend([
        "--resume".into(),
        "--data".into(),
        data.display().to_string(),
    ]);
    let (code, _, err) = fsdp(&more);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(&format!(
            "note: resuming with --data {} (the checkpoint trained on (embedded corpus))",
            data.display()
        )),
        "{err}"
    );
    assert!(
        err.contains(
            "note: resuming with --micro-batch 3 (was 1): the checkpoint consumed 4 sequences \
             of the stream (2 steps); this run continues at sequence 4, none skipped or \
             repeated; the global batch changes from 2 to 6 sequences per step"
        ),
        "{err}"
    );
}
