//! Logging setup: `tracing` to stderr, as text or JSON lines; `RUST_LOG` filters.
//!
//! A line is formatted on the thread that logs it and appended to one buffer; a thread of
//! its own writes the buffer to stderr a few milliseconds later, in one `write` for every
//! line gathered meanwhile. At a request log line per request that is one syscall per
//! few hundred requests instead of one per line, and a stderr that blocks (a full pipe,
//! a stalled terminal) never blocks the runtime: once [`MAX_BUFFERED`] bytes wait, lines
//! are dropped and counted, and the count is written when stderr drains. The buffer is
//! written out when the [`LogGuard`] is dropped and before a panic message.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Bytes of log lines that may wait for stderr; beyond it lines are dropped and counted.
pub const MAX_BUFFERED: usize = 4 << 20;
/// How long the writer gathers lines after the first one before it writes them.
const LINGER: Duration = Duration::from_millis(5);

#[derive(Debug, Default)]
struct Pending {
    bytes: Vec<u8>,
    dropped: u64,
}

#[derive(Debug, Default)]
struct Shared {
    pending: Mutex<Pending>,
    ready: Condvar,
    /// Held while writing to stderr, so a flush and the writer thread keep line order.
    out: Mutex<()>,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        // Nothing panics under this lock; a poisoned buffer is still a buffer.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn append(&self, line: &[u8]) {
        let mut pending = self.pending();
        if pending.bytes.len() + line.len() > MAX_BUFFERED {
            pending.dropped += 1;
            return;
        }
        let first = pending.bytes.is_empty();
        pending.bytes.extend_from_slice(line);
        drop(pending);
        if first {
            self.ready.notify_one();
        }
    }

    /// Writes whatever is buffered now to stderr.
    fn write_out(&self, spare: &mut Vec<u8>) {
        self.write_out_to(spare, &mut std::io::stderr().lock());
    }

    /// Writes whatever is buffered now to `out`, then the count of dropped lines.
    fn write_out_to(&self, spare: &mut Vec<u8>, out: &mut impl std::io::Write) {
        let _order = self.out.lock().unwrap_or_else(PoisonError::into_inner);
        let dropped = {
            let mut pending = self.pending();
            std::mem::swap(&mut pending.bytes, spare);
            std::mem::take(&mut pending.dropped)
        };
        let _ = out.write_all(spare);
        if dropped > 0 {
            let _ = writeln!(
                out,
                "{dropped} log lines dropped: stderr did not keep up with the log"
            );
        }
        let _ = out.flush();
        spare.clear();
        // A burst's buffer is not kept for good.
        if spare.capacity() > 256 << 10 {
            *spare = Vec::new();
        }
    }

    fn run_writer(&self) {
        let mut spare = Vec::new();
        loop {
            {
                let mut pending = self.pending();
                while pending.bytes.is_empty() && pending.dropped == 0 {
                    pending = self
                        .ready
                        .wait(pending)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
            std::thread::sleep(LINGER);
            self.write_out(&mut spare);
        }
    }
}

static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();

/// The writer handed to the `fmt` layer: appends each formatted line to the buffer.
#[derive(Clone, Debug)]
struct Buffered(Arc<Shared>);

/// One line's writer.
#[derive(Debug)]
struct Line<'a>(&'a Shared);

impl std::io::Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.append(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Buffered {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line(&self.0)
    }
}

/// Writes the buffered log lines out when dropped: hold it for the life of `main`.
#[derive(Debug)]
#[must_use = "the log is written out when the guard is dropped"]
pub struct LogGuard(());

impl Drop for LogGuard {
    fn drop(&mut self) {
        flush();
    }
}

/// Writes every buffered log line to stderr now (before a message written to stderr
/// directly, so the two keep their order).
pub fn flush() {
    if let Some(shared) = SHARED.get() {
        shared.write_out(&mut Vec::new());
    }
}

/// Installs the global subscriber (idempotent enough for one call per process).
pub fn init(format: LogFormat) -> LogGuard {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let writer = if let Some(shared) = SHARED.get() {
        BoxMakeWriter::new(Buffered(shared.clone()))
    } else {
        let shared = Arc::new(Shared::default());
        let thread_side = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || thread_side.run_writer());
        if spawned.is_ok() && SHARED.set(shared.clone()).is_ok() {
            // A panic's message goes straight to stderr: the lines before it go first.
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                flush();
                previous(info);
            }));
            BoxMakeWriter::new(Buffered(shared))
        } else {
            // No thread to write for us: every line is its own write, as it comes.
            BoxMakeWriter::new(std::io::stderr)
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(false).fmt_fields(TextFields).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    LogGuard(())
}

/// Fields of a text line as tracing-subscriber's default writes them (`message` first,
/// then `name=value` separated by spaces, strings quoted), without its per-character
/// passes: a string that needs no escaping is copied as it is, the message too. At one
/// request log line per request, the default's character-by-character escaping and
/// styling of every field was most of the 8 % of the Edge's CPU its log line cost.
#[derive(Debug, Default)]
struct TextFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for TextFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = TextVisitor {
            writer,
            result: Ok(()),
            first: true,
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct TextVisitor<'w> {
    writer: tracing_subscriber::fmt::format::Writer<'w>,
    result: std::fmt::Result,
    first: bool,
}

/// Whether `text` can be written as it is: no quote, backslash or control character
/// (C0, DEL, C1), so it can neither break the line's syntax nor drive a terminal.
fn plain(text: &str) -> bool {
    !text.chars().any(|c| c == '"' || c == '\\' || control(c))
}

fn control(c: char) -> bool {
    c < ' ' || ('\u{7f}'..='\u{9f}').contains(&c)
}

/// Writes a message through, its control characters escaped (a message is not quoted,
/// so quotes and backslashes stay as they are).
struct Message<'a, 'w>(&'a mut tracing_subscriber::fmt::format::Writer<'w>);

impl std::fmt::Write for Message<'_, '_> {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        if !text.chars().any(control) {
            return self.0.write_str(text);
        }
        for c in text.chars() {
            if control(c) {
                write!(self.0, "{}", c.escape_default())?;
            } else {
                self.0.write_char(c)?;
            }
        }
        Ok(())
    }
}

impl TextVisitor<'_> {
    fn name(&mut self, field: &tracing::field::Field) -> std::fmt::Result {
        if !std::mem::take(&mut self.first) {
            self.writer.write_char(' ')?;
        }
        let name = field.name();
        if name == "message" {
            return Ok(());
        }
        self.writer
            .write_str(name.strip_prefix("r#").unwrap_or(name))?;
        self.writer.write_char('=')
    }
}

impl tracing::field::Visit for TextVisitor<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        use std::fmt::Write;
        if self.result.is_err() {
            return;
        }
        self.result = self.name(field).and_then(|()| {
            if field.name() == "message" {
                Message(&mut self.writer).write_str(value)
            } else if plain(value) {
                write!(self.writer, "\"{value}\"")
            } else {
                write!(self.writer, "{value:?}")
            }
        });
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        if self.result.is_err() {
            return;
        }
        self.result = self.name(field).and_then(|()| {
            if field.name() == "message" {
                write!(Message(&mut self.writer), "{value:?}")
            } else {
                write!(self.writer, "{value:?}")
            }
        });
    }
}

/// Bounds the log lines one noisy source writes: at most `burst` lines per `interval`,
/// and the first line after a quiet spell says how many were suppressed. For IO events
/// that a peer or the machine can repeat at will (accept errors, failed handshakes);
/// protocol events are rate-limited by the core's own decisions.
#[derive(Debug)]
pub struct LogLimiter {
    interval: std::time::Duration,
    burst: u32,
    state: std::sync::Mutex<LimiterState>,
}

#[derive(Debug)]
struct LimiterState {
    window_start: Option<std::time::Instant>,
    in_window: u32,
    suppressed: u64,
}

impl LogLimiter {
    /// A limiter letting `burst` lines through per `interval`.
    #[must_use]
    pub fn new(interval: std::time::Duration, burst: u32) -> Self {
        LogLimiter {
            interval,
            burst,
            state: std::sync::Mutex::new(LimiterState {
                window_start: None,
                in_window: 0,
                suppressed: 0,
            }),
        }
    }

    /// `Some(suppressed since the last line)` when a line may be written now.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(std::time::Instant::now())
    }

    fn allow_at(&self, now: std::time::Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state
            .window_start
            .is_none_or(|start| now.duration_since(start) >= self.interval)
        {
            state.window_start = Some(now);
            state.in_window = 0;
        }
        if state.in_window < self.burst {
            state.in_window += 1;
            Some(std::mem::take(&mut state.suppressed))
        } else {
            state.suppressed += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The line `log` writes through a text subscriber with `TextFields` or without.
    fn line(ours: bool, log: impl FnOnce()) -> String {
        let capture = Capture::default();
        let sink = capture.clone();
        let builder = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .without_time()
            .with_level(false)
            .with_target(false)
            .with_ansi(false);
        if ours {
            tracing::subscriber::with_default(builder.fmt_fields(TextFields).finish(), log);
        } else {
            tracing::subscriber::with_default(builder.finish(), log);
        }
        let bytes = capture.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap().trim_end().to_owned()
    }

    #[test]
    fn text_lines_read_as_the_default_format_writes_them() {
        let log = || {
            let caller = "api_keys[0]";
            tracing::info!(
                request_id = "trace-4f1c",
                caller = %caller,
                node = "n1",
                status = 200u16,
                queue_ms = 0.15,
                prompt_tokens = Some(17u64),
                r#type = "chat",
                "request"
            );
        };
        let ours = line(true, log);
        assert_eq!(
            ours,
            "request request_id=\"trace-4f1c\" caller=api_keys[0] node=\"n1\" status=200 \
             queue_ms=0.15 prompt_tokens=17 type=\"chat\""
        );
        assert_eq!(ours, line(false, log));
    }

    #[test]
    fn text_lines_escape_what_could_break_the_line_or_drive_a_terminal() {
        let value = line(true, || {
            tracing::info!(model = "a\"b\\c\u{1b}[31m\u{85}", "m")
        });
        assert_eq!(value, r#"m model="a\"b\\c\u{1b}[31m\u{85}""#);
        let message = line(true, || {
            tracing::info!("two\nlines \u{1b}[2J {}", "\"quoted\"")
        });
        assert_eq!(message, r#"two\nlines \u{1b}[2J "quoted""#);
    }

    #[test]
    fn a_burst_per_interval_then_a_count_of_what_was_suppressed() {
        let limiter = LogLimiter::new(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        assert_eq!(limiter.allow_at(t0), Some(0));
        assert_eq!(limiter.allow_at(t0), Some(0));
        for _ in 0..1000 {
            assert_eq!(limiter.allow_at(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(limiter.allow_at(t0 + Duration::from_secs(10)), Some(1000));
    }

    #[test]
    fn lines_beyond_the_bound_are_counted_not_kept() {
        let shared = Shared::default();
        let line = vec![b'x'; 1 << 20];
        for _ in 0..6 {
            shared.append(&line);
        }
        {
            let pending = shared.pending();
            assert_eq!(pending.bytes.len(), MAX_BUFFERED);
            assert_eq!(pending.dropped, 2);
        }
        let mut written = Vec::new();
        shared.write_out_to(&mut Vec::new(), &mut written);
        // Every kept line, then what was dropped, said once.
        assert_eq!(
            written.len(),
            MAX_BUFFERED + "2 log lines dropped: stderr did not keep up with the log\n".len()
        );
        assert!(written.ends_with(b"xx2 log lines dropped: stderr did not keep up with the log\n"));
        let pending = shared.pending();
        assert!(pending.bytes.is_empty());
        assert_eq!(pending.dropped, 0);
        drop(pending);
        // Nothing is said twice.
        let mut again = Vec::new();
        shared.write_out_to(&mut Vec::new(), &mut again);
        assert!(again.is_empty());
    }
}
