//! The thread a command runs on.
//!
//! The kernels split their loops with rayon. Called from a thread outside the pool, each
//! parallel loop hands its work to the pool, puts the caller to sleep and wakes it at the
//! end: a few thousand sleeps and wake-ups per training step, and on two cores a third
//! thread competing with the two workers. Called from a worker of the pool, the same loop
//! runs part of the work on the calling thread and lets the other worker steal the rest.
//! So every command runs on a pool worker (measured: llama-tiny pre-ln training +6 %
//! tokens/s on 2 cores).

use anyhow::{Context, Result};

/// Runs `work` on a worker of a new rayon pool of `threads` threads, which every parallel
/// kernel inside it then uses. `None`: `RAYON_NUM_THREADS`, else one per core.
pub fn on_worker_pool<T: Send>(threads: Option<usize>, work: impl FnOnce() -> T + Send) -> Result<T> {
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(threads) = threads {
        builder = builder.num_threads(threads);
    }
    let pool = builder.build().context("could not start the worker threads")?;
    Ok(pool.install(work))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_the_work_on_a_worker_of_a_pool_of_the_given_size() {
        let (index, threads) =
            on_worker_pool(Some(3), || (rayon::current_thread_index(), rayon::current_num_threads())).unwrap();
        assert!(index.is_some(), "the work ran outside the pool");
        assert_eq!(threads, 3);
    }
}
