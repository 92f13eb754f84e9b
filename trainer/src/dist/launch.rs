//! `transponder launch`: runs this node's ranks of a data-parallel job as child processes of
//! this binary, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT), their output prefixed `[rank r] `; stops the job when a rank
//! fails and can restart it with `--resume`.
//!
//! Each rank also gets GROUP_RANK (the node rank) and TORCHELASTIC_RESTART_COUNT (0, then
//! 1, 2... on restarts), as torchrun sets them.
//!
//! Signals: Ctrl-C at a terminal reaches the launcher and every rank (one process group): the
//! ranks stop as a lone `train` does (checkpoints are atomic) and so does the launcher. A
//! signal to the launcher alone (SIGTERM, SIGKILL) ends it; each rank holds the read end of
//! a pipe from it as stdin and stops when that pipe closes (checked by the control channel,
//! so from the rendezvous on).

use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;

use super::{EXIT_PEER_FAILED, LAUNCHER_PIPE_ENV};

/// Test hook: the program the ranks run instead of this binary (a shell script in tests).
const PROGRAM_ENV: &str = "TRANSPONDER_LAUNCH_PROGRAM";

/// `transponder launch --nproc-per-node N [--nnodes M --node-rank K --master-addr A
/// --master-port P] [--max-restarts R] -- train ...`
#[derive(Args, Clone, Debug)]
pub struct LaunchArgs {
    /// Ranks (processes, one per GPU) to run on this node.
    #[arg(long)]
    pub nproc_per_node: usize,
    /// Nodes in the job: run this launcher on each, with its --node-rank.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, 0..nnodes (node 0 hosts rank 0).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Host rank 0 listens on for the rendezvous (node 0's address as the others see it).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// After a failure, restart every rank with --resume up to this many times.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// Seconds the other ranks get to stop on their own after one fails, before they are killed.
    #[arg(long, default_value_t = 15.0)]
    pub grace_period: f64,
    /// The command every rank runs (a `transponder` subcommand and its arguments).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Runs the node's ranks until they all succeed (0), or until one fails and the restarts are
/// used up: then the exit code of the rank that failed first (128 + signal for a killed one),
/// preferring a rank that failed on its own over one stopped by a peer's failure.
pub fn launch(args: &LaunchArgs) -> Result<i32> {
    ensure!(args.nproc_per_node >= 1, "--nproc-per-node must be at least 1");
    ensure!(args.nnodes >= 1, "--nnodes must be at least 1");
    ensure!(
        args.node_rank < args.nnodes,
        "--node-rank {} is out of range for --nnodes {}",
        args.node_rank,
        args.nnodes
    );
    ensure!(args.grace_period.is_finite() && args.grace_period >= 0.0, "--grace-period must be a number of seconds");
    ensure!(args.command.first().map(OsString::as_os_str) != Some(OsStr::new("launch")), "launch cannot launch itself");
    let program = match std::env::var_os(PROGRAM_ENV) {
        Some(program) => PathBuf::from(program),
        None => std::env::current_exe().context("finding this binary to launch the ranks")?,
    };
    let mut command = args.command.clone();
    let mut restart = 0;
    while let Some(failure) = run_ranks(args, &program, &command, restart)? {
        if restart == args.max_restarts {
            note(&format!("rank {} {}: stopping the job", failure.rank, failure.how));
            return Ok(failure.code);
        }
        restart += 1;
        note(&format!(
            "rank {} {}: restarting all ranks with --resume (restart {restart} of {})",
            failure.rank, failure.how, args.max_restarts
        ));
        // --overwrite conflicts with --resume: the restart continues what the first try wrote.
        command.retain(|arg| arg != "--overwrite");
        if !command.iter().any(|arg| arg == "--resume") {
            command.push("--resume".into());
        }
    }
    Ok(0)
}

/// The rank whose failure ends a try.
struct Failure {
    rank: usize,
    code: i32,
    how: String,
}

/// One running rank.
struct Rank {
    rank: usize,
    child: Child,
    /// Held open while the rank runs: its end tells the rank the launcher is gone.
    _pipe: Option<ChildStdin>,
    forwarders: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
}

/// Starts the node's ranks and waits for them; the failure that ended the try, if one did.
fn run_ranks(args: &LaunchArgs, program: &PathBuf, command: &[OsString], restart: usize) -> Result<Option<Failure>> {
    let (n, world_size) = (args.nproc_per_node, args.nproc_per_node * args.nnodes);
    let mut ranks: Vec<Rank> = Vec::with_capacity(n);
    for local_rank in 0..n {
        let rank = args.node_rank * n + local_rank;
        let spawned = Command::new(program)
            .args(command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("TORCHELASTIC_RESTART_COUNT", restart.to_string())
            .env(LAUNCHER_PIPE_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(if rank == 0 { Stdio::inherit() } else { Stdio::piped() })
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(error) => {
                kill_all(&mut ranks);
                return Err(error).with_context(|| format!("starting rank {rank} ({})", program.display()));
            }
        };
        let mut forwarders = Vec::new();
        if let Some(stdout) = child.stdout.take() {
            forwarders.push(forward(stdout, rank, false));
        }
        if let Some(stderr) = child.stderr.take() {
            forwarders.push(forward(stderr, rank, true));
        }
        let pipe = child.stdin.take();
        ranks.push(Rank { rank, child, _pipe: pipe, forwarders, status: None });
    }
    let failure = wait_all(&mut ranks, Duration::from_secs_f64(args.grace_period))?;
    for rank in &mut ranks {
        for forwarder in rank.forwarders.drain(..) {
            let _ = forwarder.join();
        }
    }
    Ok(failure)
}

/// Copies `output`'s lines to this process's stderr (or stdout) behind `[rank r] `, one
/// `write_all` a line so ranks' lines never interleave mid-line.
fn forward(output: impl Read + Send + 'static, rank: usize, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(output).split(b'\n') {
            let Ok(line) = line else { return };
            let mut bytes = format!("[rank {rank}] ").into_bytes();
            bytes.extend_from_slice(&line);
            bytes.push(b'\n');
            // A closed stderr/stdout: keep draining so the rank never blocks on a full pipe.
            let _ = if to_stderr { std::io::stderr().write_all(&bytes) } else { std::io::stdout().write_all(&bytes) };
        }
    })
}

/// Waits for every rank; after the first failure the others get `grace` to stop (through
/// the control channel) before they are killed.
fn wait_all(ranks: &mut [Rank], grace: Duration) -> Result<Option<Failure>> {
    let mut failure: Option<Failure> = None;
    let mut deadline: Option<Instant> = None;
    loop {
        for rank in ranks.iter_mut().filter(|rank| rank.status.is_none()) {
            let Some(status) = rank.child.try_wait().with_context(|| format!("waiting for rank {}", rank.rank))? else {
                continue;
            };
            rank.status = Some(status);
            if status.success() {
                continue;
            }
            let (code, how) = match (status.code(), status.signal()) {
                (Some(code), _) => (code, format!("exited with code {code}")),
                (None, Some(signal)) => (128 + signal, format!("was killed by signal {signal}")),
                (None, None) => (1, format!("ended with {status}")),
            };
            // A rank stopped by a peer's failure is not the cause, if the cause is known.
            let replaces =
                failure.as_ref().is_none_or(|first| first.code == EXIT_PEER_FAILED && code != EXIT_PEER_FAILED);
            if replaces {
                failure = Some(Failure { rank: rank.rank, code, how });
            }
            deadline.get_or_insert_with(|| Instant::now() + grace);
        }
        if ranks.iter().all(|rank| rank.status.is_some()) {
            return Ok(failure);
        }
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            for rank in ranks.iter().filter(|rank| rank.status.is_none()) {
                note(&format!(
                    "rank {} still running {} s after rank {} failed: killing it",
                    rank.rank,
                    grace.as_secs_f64(),
                    failure.as_ref().map_or(0, |f| f.rank)
                ));
            }
            kill_all(ranks);
            return Ok(failure);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The launcher's own line on stderr, `launch: ` first (best effort: the exit code still tells).
fn note(line: &str) {
    let _ = writeln!(std::io::stderr(), "launch: {line}");
}

/// Kills (SIGKILL) and reaps every rank still running.
fn kill_all(ranks: &mut [Rank]) {
    for rank in ranks.iter_mut().filter(|rank| rank.status.is_none()) {
        let _ = rank.child.kill();
        rank.status = rank.child.wait().ok();
    }
}
