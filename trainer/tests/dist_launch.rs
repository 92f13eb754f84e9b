//! `transponder launch`: each rank's environment, its output prefixed `[rank r]`, the failing
//! rank's exit code, the siblings killed after the grace period, restarts with `--resume`.
//! Most ranks here are small shell scripts (`TRANSPONDER_LAUNCH_PROGRAM=/bin/sh`) so that
//! one rank can fail while another hangs; the first test launches the binary itself.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_transponder"));
    command.arg("launch").args(args);
    command
}

/// `launch` of `/bin/sh -c <script>` on `ranks` ranks, after `flags`.
fn launch_script(ranks: usize, flags: &[&str], script: &str, script_args: &[&str]) -> Output {
    let nproc = ranks.to_string();
    let mut args = vec!["--nproc-per-node", &nproc, "--grace-period", "0.5"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "-c", script, "sh"]);
    args.extend_from_slice(script_args);
    launch(&args).env("TRANSPONDER_LAUNCH_PROGRAM", "/bin/sh").output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_failing_subcommand_fails_the_launch_with_its_code() {
    let output =
        launch(&["--nproc-per-node", "2", "--", "eval", "no-such.safetensors", "no-such.bin"]).output().unwrap();
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    for rank in 0..2 {
        assert!(stderr.contains(&format!("[rank {rank}] Error: ")), "{stderr}");
    }
    assert!(stderr.contains("exited with code 1: stopping the job"), "{stderr}");
}

#[test]
fn each_rank_gets_torchruns_environment_and_prefixed_output() {
    let script = r#"echo "out $RANK"; echo "rank $RANK of $WORLD_SIZE, local $LOCAL_RANK of $LOCAL_WORLD_SIZE, $MASTER_ADDR:$MASTER_PORT" >&2"#;
    let output = launch_script(
        2,
        &["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port", "4242"],
        script,
        &[],
    );
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("[rank 2] rank 2 of 4, local 0 of 2, 10.1.2.3:4242\n"), "{stderr}");
    assert!(stderr.contains("[rank 3] rank 3 of 4, local 1 of 2, 10.1.2.3:4242\n"), "{stderr}");
    assert!(stdout.contains("[rank 2] out 2\n") && stdout.contains("[rank 3] out 3\n"), "{stdout}");

    let output = launch_script(2, &[], r#"echo "out $RANK""#, &[]);
    let stdout = text(&output.stdout);
    assert!(stdout.lines().any(|line| line == "out 0"), "rank 0's stdout passes through: {stdout}");
    assert!(stdout.contains("[rank 1] out 1\n"), "{stdout}");
}

#[test]
fn a_hanging_sibling_is_killed_after_the_grace_period() {
    let started = Instant::now();
    let script = r#"if [ "$RANK" = 1 ]; then echo "rank 1 gives up" >&2; exit 7; fi; exec sleep 60"#;
    let output = launch_script(3, &[], script, &[]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("[rank 1] rank 1 gives up\n"), "{stderr}");
    assert!(stderr.contains("launch: rank 0 still running 0.5 s after rank 1 failed: killing it"), "{stderr}");
    assert!(stderr.contains("launch: rank 1 exited with code 7: stopping the job"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
}

#[test]
fn the_rank_that_failed_on_its_own_gives_the_code() {
    // Rank 0 stops first, as a peer's failure stops it (exit 3); rank 1 is the cause.
    let script = r#"if [ "$RANK" = 0 ]; then exit 3; fi; sleep 0.2; exit 9"#;
    assert_eq!(launch_script(2, &[], script, &[]).status.code(), Some(9));
    let output = launch_script(2, &[], r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; exec sleep 60"#, &[]);
    assert_eq!(output.status.code(), Some(128 + 9), "{}", text(&output.stderr));
    assert!(text(&output.stderr).contains("rank 1 was killed by signal 9"), "{}", text(&output.stderr));
}

#[test]
fn a_restart_resumes_every_rank() {
    let script = r#"echo "try $TORCHELASTIC_RESTART_COUNT: $*" >&2; [ "$*" = "--resume" ] && exit 0; exit 5"#;
    let output = launch_script(2, &["--max-restarts", "2"], script, &["--overwrite"]);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("restarting all ranks with --resume (restart 1 of 2)"), "{stderr}");
    for rank in 0..2 {
        assert!(stderr.contains(&format!("[rank {rank}] try 0: --overwrite\n")), "{stderr}");
        assert!(stderr.contains(&format!("[rank {rank}] try 1: --resume\n")), "{stderr}");
    }
    assert!(!stderr.contains("restart 2 of 2"), "{stderr}");

    let output = launch_script(1, &["--max-restarts", "1"], r#"echo "try $*" >&2; exit 5"#, &[]);
    let stderr = text(&output.stderr);
    assert_eq!(output.status.code(), Some(5), "{stderr}");
    assert!(stderr.contains("[rank 0] try \n") && stderr.contains("[rank 0] try --resume\n"), "{stderr}");
}

#[test]
fn ranks_see_their_stdin_close_when_the_launcher_dies() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"[ -n "$TRANSPONDER_LAUNCHER_PIPE" ] && cat > /dev/null; echo gone > "$1/rank$RANK""#;
    let mut launcher = launch(&["--nproc-per-node", "2", "--", "-c", script, "sh", dir.path().to_str().unwrap()])
        .env("TRANSPONDER_LAUNCH_PROGRAM", "/bin/sh")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(launcher.try_wait().unwrap().is_none(), "the ranks wait for the launcher's pipe");
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let started = Instant::now();
    for rank in 0..2 {
        let marker = dir.path().join(format!("rank{rank}"));
        while !Path::new(&marker).exists() {
            assert!(started.elapsed() < Duration::from_secs(10), "rank {rank} outlived the launcher");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn bad_launch_arguments_are_refused() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--", "train"],
            "--node-rank 2 is out of range for --nnodes 2",
        ),
        (&["--nproc-per-node", "0", "--", "train"], "--nproc-per-node must be at least 1"),
        (&["--nproc-per-node", "1", "--", "launch"], "launch cannot launch itself"),
    ];
    for (args, want) in cases {
        let output = launch(args).output().unwrap();
        assert_eq!(output.status.code(), Some(1));
        assert!(text(&output.stderr).contains(want), "{}", text(&output.stderr));
    }
}
