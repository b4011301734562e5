//! What the two IOP shells (`iop-edge`, `iop-node`) share. No protocol decisions live
//! here; those are in [`iop_proto_core`].
//!
//! - [`cancel`]: a cancel for one piece of work, waited on by one task.
//! - [`clock`]: the monotonic clock mapped onto the core's `Timestamp`.
//! - [`config`]: reading a TOML file, errors naming the file or the key.
//! - [`deadline`]: a deadline that moves often, over one runtime timer; timers kept for
//!   reuse.
//! - [`logging`]: `tracing` to stderr as text or JSON lines.
//! - [`offload`]: CPU work on large request bytes, off the event loop.
//! - [`process`]: the runtime and the shutdown signals of a binary.
//! - [`tls`]: PEM files, certificate fingerprints and names, server configurations.

pub mod cancel;
pub mod clock;
pub mod config;
pub mod deadline;
pub mod logging;
pub mod offload;
pub mod process;
pub mod repoll;
pub mod tls;

/// `Box::pin($value)` with the box taken before the value is made. A future's slot is
/// as large as its largest state (kilobytes for a request's handler), and
/// `Box::pin(handler(args))` made it on the stack and copied all of it into the heap per
/// request, though only the arguments were set. With the box taken first the optimizer
/// may write the value straight into it; whether it does depends on how the value is
/// made (an async block was still copied, an `async fn` called was not, and one marked
/// `#[inline(never)]` was or was not), so each use was checked in the profile
/// (`scripts/instructions`: `memcpy` under its caller). A panic while making the value
/// frees the box.
#[macro_export]
macro_rules! in_box {
    ($value:expr) => {
        ::std::boxed::Box::into_pin(::std::boxed::Box::write(
            ::std::boxed::Box::new_uninit(),
            $value,
        ))
    };
}

/// The size of a connection's next read, following the traffic: doubled (up to `max`)
/// after a read that filled the last one's `want` bytes, back to `min` after one that
/// used under a quarter of them. A quiet connection reads into little, a busy one in large
/// reads.
#[must_use]
pub fn next_read_size(want: usize, read: usize, min: usize, max: usize) -> usize {
    if read >= want {
        (want * 2).min(max)
    } else if read < want / 4 {
        min
    } else {
        want
    }
}

/// A state machine refused an input the shell gave it: that is a bug in the shell, not
/// something a peer can cause. It is logged at ERROR with the input and the machine's
/// reason, and stops debug builds (tests) at once; release builds carry on without the
/// input. Expected refusals (a cancel racing the end of its request, a request the
/// caller got wrong) are matched by the caller instead.
#[track_caller]
pub fn misuse<T, E: std::fmt::Display>(input: &'static str, result: Result<T, E>) -> Option<T> {
    match result {
        Ok(value) => Some(value),
        Err(err) => {
            tracing::error!(
                input,
                error = %err,
                "a state machine refused an input: this is a bug in the shell"
            );
            debug_assert!(false, "{input} refused: {err}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_read_size_follows_the_traffic() {
        let (min, max) = (1 << 10, 64 << 10);
        let mut want = min;
        for _ in 0..10 {
            want = super::next_read_size(want, want, min, max);
        }
        assert_eq!(want, max, "full reads grow it to the cap");
        assert_eq!(super::next_read_size(max, max / 2, min, max), max, "steady");
        assert_eq!(
            super::next_read_size(max, 40, min, max),
            min,
            "a small read resets it"
        );
    }
}
