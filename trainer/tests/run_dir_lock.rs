//! One writer per output directory: a command that writes into a directory another process
//! is writing into (a run, a `prepare` or `export` target, a `compare` tree) is refused with a
//! message naming that process, before it writes anything.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use trainer::dir_lock::{DirLock, LOCK_FILE};

/// Waits until `path` exists (the other run has started writing), failing after a minute.
fn wait_for(path: &Path, child: &mut Child) {
    let started = Instant::now();
    while !path.exists() {
        assert!(child.try_wait().unwrap().is_none(), "the first run ended before writing {}", path.display());
        assert!(started.elapsed() < Duration::from_secs(60), "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_second_train_into_a_directory_in_use_is_refused_naming_the_first() {
    let dir = scratch("lock", "train");
    let out = dir.join("run");
    let endless = [tiny_train(&dir, &out, 1_000_000), strings(&["--save-every", "1"])].concat();
    let mut first = transponder(&dir, &endless).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    wait_for(&out.join("checkpoint.safetensors"), &mut first);
    let config_before = std::fs::read(out.join("config.json")).unwrap();

    let refused = run(&dir, &tiny_train(&dir, &out, 2));
    let resumed = run(&dir, &[tiny_train(&dir, &out, 2), strings(&["--resume"])].concat());
    first.kill().unwrap();
    first.wait().unwrap();

    let pid = first.id().to_string();
    assert_fails_with(&refused, &["in use by process", &pid, "transponder train"]);
    assert_fails_with(&resumed, &["in use by process", &pid]);
    assert_eq!(std::fs::read(out.join("config.json")).unwrap(), config_before, "the refused run wrote its config");
    // Killed, the first run holds nothing: its directory can be resumed.
    let next = (checkpoint_step(&out) + 1).to_string();
    assert_succeeds(&run(&dir, &strings(&["train", "--resume", "--out-dir", "run", "--steps", &next])));
}

#[test]
fn every_writing_command_is_refused_from_a_locked_directory() {
    let dir = scratch("lock", "commands");
    let run_dir = dir.join("run");
    assert_succeeds(&run(&dir, &tiny_train(&dir, &run_dir, 1)));
    let checkpoint = run_dir.join("checkpoint.safetensors").display().to_string();
    std::fs::write(dir.join("text.txt"), "to be or not to be, that is the question. ".repeat(10)).unwrap();

    let locked = dir.join("locked");
    let _lock = DirLock::acquire(&locked).unwrap();
    let target = locked.display().to_string();
    let pid = std::process::id().to_string();
    for args in [
        tiny_train(&dir, &locked, 1),
        strings(&["train-image", "--epochs", "1", "--out-dir", &target]),
        strings(&["prepare", "text.txt", "--out", &target]),
        strings(&["export", &checkpoint, &target]),
        strings(&["analyze", "--checkpoint", &checkpoint, "--text", "text.txt", "--out", &target]),
        strings(&["compare", "--variants", "pre-ln", "--steps", "1", "--seeds", "1", "--out-dir", &target]),
    ] {
        let output = run(&dir, &args);
        assert_fails_with(&output, &["in use by process", &pid]);
        let written: Vec<_> = std::fs::read_dir(&locked).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(written, [LOCK_FILE], "{args:?} wrote into the locked directory");
    }
}

#[test]
fn the_next_holder_removes_the_temporary_files_of_a_killed_writer() {
    let dir = scratch("lock", "strays");
    let stray = dir.join("checkpoint.safetensors.4242.tmp");
    let own = dir.join("notes.tmp");
    std::fs::write(&stray, b"half a checkpoint").unwrap();
    std::fs::write(&own, b"the user's").unwrap();
    let lock = DirLock::acquire(&dir).unwrap();
    assert!(!stray.exists() && own.exists());
    // Released, the directory is free again; a missing one is created and, left empty, removed.
    drop(lock);
    DirLock::acquire(&dir).unwrap();
    let fresh = dir.join("a/b");
    drop(DirLock::acquire(&fresh).unwrap());
    assert!(!dir.join("a").exists(), "an unused directory the lock created must not stay");
}
