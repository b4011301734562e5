//! CPU work on a request's bytes (reading JSON, converting it) kept off the event loop
//! when the bytes are many. Both shells poll their streams on few threads (the Node on
//! one, the Edge on one per two CPUs by default), and reading megabytes of JSON there
//! takes tens of milliseconds in a release build: every other stream's chunks, and the
//! node link's heartbeats, would wait meanwhile.

use bytes::Bytes;

/// Inputs of this many bytes or more are worked on tokio's blocking pool.
pub const INLINE_MAX: usize = 128 << 10;

/// Why work handed to the blocking pool gave no result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotDone {
    /// The runtime is stopping.
    #[error("the runtime is stopping")]
    Stopping,
    /// The work panicked (a bug in it, caught at the pool's edge).
    #[error("the work panicked")]
    Panicked,
}

/// `work(input)`, where it does not hold up the event loop: inline for an input under
/// [`INLINE_MAX`], on the blocking pool for a larger one, at most one per CPU at a time
/// ([`slots`]); more wait their turn, their bytes already held by the caller. Dropping the
/// future gives up a wait for a slot, so a caller races it with its request's
/// cancellation; work already started runs to its end on the pool and is thrown away.
pub async fn run<T, F>(input: &Bytes, work: F) -> Result<T, NotDone>
where
    T: Send + 'static,
    F: FnOnce(&[u8]) -> T + Send + 'static,
{
    if input.len() < INLINE_MAX {
        return Ok(work(input));
    }
    // The semaphore is never closed; a closed one would mean the process is going away.
    let _slot = slots().acquire().await.map_err(|_| NotDone::Stopping)?;
    let input = input.clone();
    match tokio::task::spawn_blocking(move || work(&input)).await {
        Ok(done) => Ok(done),
        Err(err) if err.is_cancelled() => Err(NotDone::Stopping),
        Err(_) => Err(NotDone::Panicked),
    }
}

/// The large works [`run`] may run at a time: one per CPU this process may use.
pub fn slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    SLOTS.get_or_init(|| {
        tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn a_large_input_is_worked_off_the_event_loop() {
        let here = std::thread::current().id();
        let small = Bytes::from(vec![b' '; INLINE_MAX - 1]);
        let large = Bytes::from(vec![b' '; INLINE_MAX]);
        let inline = run(&small, |input| (std::thread::current().id(), input.len())).await;
        assert_eq!(inline, Ok((here, INLINE_MAX - 1)));
        let (there, read) = run(&large, |input| (std::thread::current().id(), input.len()))
            .await
            .expect("worked");
        assert_ne!(there, here, "a large input was worked on the event loop");
        assert_eq!(read, INLINE_MAX);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn work_that_panics_ends_in_an_error_not_in_a_panic() {
        let large = Bytes::from(vec![0; INLINE_MAX]);
        let worked: Result<u8, NotDone> = run(&large, |_| panic!("a bug in the work")).await;
        assert_eq!(worked, Err(NotDone::Panicked));
    }
}
