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
    let mut buffered = true;
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
            buffered = false;
            BoxMakeWriter::new(std::io::stderr)
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_timer(Clock)
        .with_target(false);
    let installed = match format {
        LogFormat::Text => builder
            .with_ansi(false)
            .fmt_fields(TextFields)
            .event_format(TextLine { time: true })
            .try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if installed.is_ok() {
        DIRECT.store(
            buffered && format == LogFormat::Text,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    LogGuard(())
}

/// Whether the installed subscriber writes text lines into the buffer, so that
/// [`info_direct`] may write a line there itself.
static DIRECT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One value of an [`info_direct`] line, written as the text format writes that value
/// when `tracing` records it.
#[derive(Clone, Copy, Debug)]
pub enum Field<'a> {
    /// A string (`name = value`): quoted, escaped as `Debug` escapes it where it must be.
    Str(&'a str),
    /// A string its caller knows to be printable ASCII without a quote or a backslash
    /// (a validated request id, a constant): written as [`Field::Str`] writes it, without
    /// checking each byte again. Never for text a peer or a caller chose unchecked.
    Quoted(&'a str),
    /// A string shown as it displays (`name = %value`): neither quoted nor escaped.
    Bare(&'a str),
    /// An unsigned integer (every unsigned width records as one).
    U64(u64),
    /// A count of thousandths, written as the float `n / 1000` is (`-1.0`, `0.15`,
    /// `18.467`) without the float's arithmetic.
    Milli(i64),
}

/// An INFO line for [`info_direct`]: its message and its fields, each with the text that
/// comes before its value (a space, its name, `=`). [`direct_line!`](crate::direct_line)
/// makes one, with that text put together at compile time.
#[derive(Clone, Copy, Debug)]
pub struct DirectLine<'a> {
    /// The message: a literal, printable ASCII.
    pub message: &'static str,
    /// Each field: ` name=` and its value (`None` leaves the field out).
    pub fields: &'a [(&'static str, Option<Field<'a>>)],
}

/// A [`DirectLine`]: `direct_line!("request", request_id: Some(Field::Quoted(id)), ...)`,
/// each value an `Option<Field>`, as `tracing::info!(request_id = ..., "request")` names
/// them.
#[macro_export]
macro_rules! direct_line {
    ($message:literal $(, $name:ident: $value:expr)* $(,)?) => {
        $crate::logging::DirectLine {
            message: $message,
            fields: &[$((concat!(" ", stringify!($name), "="), $value)),*],
        }
    };
}

/// Writes an INFO line into the log's buffer, byte for byte as
/// `tracing::info!(name = value, ..., "message")` writes it through the text format
/// (a field that is `None` left out, as `tracing` leaves out an `Option` that is `None`),
/// without `tracing`'s per-field dispatch: a line per request that went through it cost
/// the Edge about 5,500 instructions (BENCHMARKS.md). The caller checks first that the
/// event is enabled (`tracing::enabled!` with its target). `false`, with nothing written,
/// where the line must go through `tracing` instead: JSON lines, no buffered writer, or
/// inside a span (whose fields the line would carry).
pub fn info_direct(line: &DirectLine<'_>) -> bool {
    if !DIRECT.load(std::sync::atomic::Ordering::Relaxed) {
        return false;
    }
    let Some(shared) = SHARED.get() else {
        return false;
    };
    if !tracing::Span::current().is_none() {
        return false;
    }
    with_scratch(|out| {
        if !Clock::push_stamp(out) {
            return false;
        }
        out.push_str("  INFO ");
        if write_fields(out, line).is_ok() {
            out.push('\n');
            shared.append(out.as_bytes());
        }
        true
    })
}

/// `line`'s message and fields as [`TextFields`] writes an event's.
fn write_fields(out: &mut String, line: &DirectLine<'_>) -> std::fmt::Result {
    use std::fmt::Write;
    // A literal of printable ASCII, as a message needs no escapes.
    debug_assert!(!line.message.chars().any(control));
    out.push_str(line.message);
    for (start, value) in line.fields {
        let Some(value) = value else { continue };
        debug_assert!(start.starts_with(' ') && start.ends_with('='));
        out.push_str(start);
        let quoted = |out: &mut String, text: &str| {
            out.push('"');
            out.push_str(text);
            out.push('"');
        };
        match *value {
            Field::Str(text) if plain(text) => quoted(out, text),
            Field::Str(text) => write!(out, "{text:?}")?,
            Field::Quoted(text) => {
                debug_assert!(plain_ascii(text.as_bytes()), "{text:?} needs escapes");
                quoted(out, text);
            }
            Field::Bare(text) => out.push_str(text),
            Field::U64(n) => push_decimal(out, n),
            Field::Milli(n) => push_milli(out, n < 0, n.unsigned_abs()),
        }
    }
    Ok(())
}

/// Each line's timestamp as tracing-subscriber's `SystemTime` writes it (RFC 3339 in UTC
/// with microseconds, `2026-12-01T03:28:07.123456Z`), with the date and time of day worked
/// out once per second per thread instead of formatted field by field on every line
/// (a request log line per request makes it hot).
#[derive(Debug, Clone, Copy)]
struct Clock;

impl Clock {
    /// Appends the timestamp's 27 characters; `false`, with nothing written, for a clock
    /// outside years 1970-9999. The second's text is kept as a `String`, so a line copies
    /// it in and pushes the microseconds: nothing is checked as UTF-8 per line.
    fn push_stamp(out: &mut String) -> bool {
        use std::cell::RefCell;
        thread_local! {
            /// The second last formatted and its `YYYY-MM-DDTHH:MM:SS.`.
            static LAST: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
        }
        let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) else {
            return false;
        };
        let secs = now.as_secs();
        LAST.with_borrow_mut(|(cached, prefix)| {
            if *cached != secs {
                let Some(text) = second_prefix(secs) else {
                    return false;
                };
                prefix.clear();
                push_ascii(prefix, &text);
                *cached = secs;
            }
            out.push_str(prefix);
            let mut micros = [0u8; 6];
            digits(&mut micros, now.subsec_micros().into());
            push_ascii(out, &micros);
            out.push('Z');
            true
        })
    }
}

impl tracing_subscriber::fmt::time::FormatTime for Clock {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        with_scratch(|out| {
            if Clock::push_stamp(out) {
                w.write_str(out)
            } else {
                // A clock before 1970: the general formatter knows how to write it.
                tracing_subscriber::fmt::time::SystemTime.format_time(w)
            }
        })
    }
}

/// `YYYY-MM-DDTHH:MM:SS.` of a second since the Unix epoch, for years up to 9999.
fn second_prefix(secs: u64) -> Option<[u8; 20]> {
    let days = i64::try_from(secs / 86_400).ok()?;
    let of_day = u32::try_from(secs % 86_400).ok()?;
    // Howard Hinnant's `civil_from_days`: the proleptic Gregorian date of a day count.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    if !(0..=9999).contains(&year) {
        return None;
    }
    let mut out = *b"0000-00-00T00:00:00.";
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let of_day = u64::from(of_day);
    digits(&mut out[0..4], n(year));
    digits(&mut out[5..7], n(month));
    digits(&mut out[8..10], n(day));
    digits(&mut out[11..13], of_day / 3_600);
    digits(&mut out[14..16], of_day / 60 % 60);
    digits(&mut out[17..19], of_day % 60);
    Some(out)
}

/// `value`'s last `out.len()` decimal digits, zero-padded.
fn digits(out: &mut [u8], mut value: u64) {
    for slot in out.iter_mut().rev() {
        *slot = b'0' + (value % 10) as u8;
        value /= 10;
    }
}

/// Fields of a text line as tracing-subscriber's default writes them (`message` first,
/// then `name=value` separated by spaces, strings quoted), without its per-character
/// passes: a string that needs no escaping is copied as it is, the message too. At one
/// request log line per request, the default's character-by-character escaping and
/// styling of every field was most of what the line cost the Edge
/// (docs/benchmarks-history.md).
#[derive(Debug, Default)]
struct TextFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for TextFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        with_scratch(|out| {
            let result = record_text(out, fields);
            result.and_then(|()| writer.write_str(out))
        })
    }
}

/// Runs `f` with this thread's empty scratch line (kept between lines; a huge one is
/// given back).
fn with_scratch<T>(f: impl FnOnce(&mut String) -> T) -> T {
    use std::cell::RefCell;
    thread_local! {
        static SCRATCH: RefCell<String> = RefCell::new(String::with_capacity(512));
    }
    SCRATCH.with(|cell| {
        // Taken out, so a line logged while formatting one (never done) gets its own.
        let mut out = cell.take();
        out.clear();
        let result = f(&mut out);
        if out.capacity() <= 64 << 10 {
            cell.replace(out);
        }
        result
    })
}

/// Appends `fields` to `out` as [`TextFields`] writes them.
fn record_text(
    out: &mut String,
    fields: impl tracing_subscriber::field::RecordFields,
) -> std::fmt::Result {
    let mut visitor = TextVisitor {
        out,
        result: Ok(()),
        first: true,
    };
    fields.record(&mut visitor);
    visitor.result
}

/// A text line as tracing-subscriber's full format writes it without ANSI colours and
/// targets (`2026-12-01T03:28:07.123456Z  INFO span{a=1}: message key=value`), put
/// together in one buffer and handed to the writer in one piece: the default format
/// writes each piece through a `dyn Write`, which cost more than the line's content.
#[derive(Debug, Clone, Copy)]
struct TextLine {
    /// Whether lines start with the time (tests leave it out).
    time: bool,
}

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for TextLine
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use std::fmt::Write;
        with_scratch(|out| {
            if self.time {
                if !Clock::push_stamp(out) {
                    // A clock before 1970: the general formatter knows how to write it.
                    let mut w = tracing_subscriber::fmt::format::Writer::new(&mut *out);
                    tracing_subscriber::fmt::time::FormatTime::format_time(
                        &tracing_subscriber::fmt::time::SystemTime,
                        &mut w,
                    )?;
                }
                out.push(' ');
            }
            out.push_str(match *event.metadata().level() {
                tracing::Level::ERROR => "ERROR ",
                tracing::Level::WARN => " WARN ",
                tracing::Level::INFO => " INFO ",
                tracing::Level::DEBUG => "DEBUG ",
                tracing::Level::TRACE => "TRACE ",
            });
            if let Some(scope) = ctx.event_scope() {
                let mut any = false;
                for span in scope.from_root() {
                    out.push_str(span.name());
                    let ext = span.extensions();
                    if let Some(fields) = ext.get::<tracing_subscriber::fmt::FormattedFields<N>>()
                        && !fields.is_empty()
                    {
                        write!(out, "{{{fields}}}")?;
                    }
                    out.push(':');
                    any = true;
                }
                if any {
                    out.push(' ');
                }
            }
            record_text(out, event)?;
            out.push('\n');
            writer.write_str(out)
        })
    }
}

struct TextVisitor<'a> {
    out: &'a mut String,
    result: std::fmt::Result,
    first: bool,
}

/// Whether `text` can be written as it is: no quote, backslash or control character
/// (C0, DEL, C1), so it can neither break the line's syntax nor drive a terminal.
fn plain(text: &str) -> bool {
    // Printable ASCII decides most values without decoding a character.
    plain_ascii(text.as_bytes()) || !text.chars().any(|c| c == '"' || c == '\\' || control(c))
}

/// Whether `bytes` are printable ASCII without a quote or backslash, read eight at a time
/// (a log line's ids and names are checked on every line; byte by byte the check cost
/// the Edge and the Node about 500 instructions per request each).
fn plain_ascii(bytes: &[u8]) -> bool {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    // Whether some byte of `v` is below `n` (exact for any `n` up to 0x80).
    let below = |v: u64, n: u8| v.wrapping_sub(ONES * u64::from(n)) & !v & HIGHS != 0;
    let has = |v: u64, b: u8| below(v ^ (ONES * u64::from(b)), 1);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let Ok(eight) = <[u8; 8]>::try_from(chunk) else {
            return false;
        };
        let v = u64::from_le_bytes(eight);
        if v & HIGHS != 0 || below(v, b' ') || has(v, 0x7f) || has(v, b'"') || has(v, b'\\') {
            return false;
        }
    }
    chunks
        .remainder()
        .iter()
        .all(|&b| (b' '..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

fn control(c: char) -> bool {
    c < ' ' || ('\u{7f}'..='\u{9f}').contains(&c)
}

/// Writes a message through, its control characters escaped (a message is not quoted,
/// so quotes and backslashes stay as they are).
struct Message<'a>(&'a mut String);

impl std::fmt::Write for Message<'_> {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        // Printable ASCII decides most messages eight bytes at a time.
        if plain_ascii(text.as_bytes()) || !text.chars().any(control) {
            self.0.push_str(text);
            return Ok(());
        }
        for c in text.chars() {
            if control(c) {
                write!(self.0, "{}", c.escape_default())?;
            } else {
                self.0.push(c);
            }
        }
        Ok(())
    }
}

impl TextVisitor<'_> {
    fn name(&mut self, field: &tracing::field::Field) {
        if !std::mem::take(&mut self.first) {
            self.out.push(' ');
        }
        let name = field.name();
        if name == "message" {
            return;
        }
        self.out.push_str(name.strip_prefix("r#").unwrap_or(name));
        self.out.push('=');
    }
}

impl tracing::field::Visit for TextVisitor<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        use std::fmt::Write;
        if self.result.is_err() {
            return;
        }
        self.name(field);
        if field.name() == "message" {
            self.result = Message(self.out).write_str(value);
        } else if plain(value) {
            self.out.push('"');
            self.out.push_str(value);
            self.out.push('"');
        } else {
            self.result = write!(self.out, "{value:?}");
        }
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if self.result.is_err() {
            return;
        }
        self.name(field);
        push_decimal(self.out, value);
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        if self.result.is_err() {
            return;
        }
        self.name(field);
        if value < 0 {
            self.out.push('-');
        }
        push_decimal(self.out, value.unsigned_abs());
    }

    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        use std::fmt::Write;
        if self.result.is_err() {
            return;
        }
        self.name(field);
        match thousandths(value) {
            Some(n) => push_milli(self.out, value.is_sign_negative(), n),
            None => self.result = write!(self.out, "{value:?}"),
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write;
        if self.result.is_err() {
            return;
        }
        self.name(field);
        self.result = if field.name() == "message" {
            write!(Message(self.out), "{value:?}")
        } else {
            write!(self.out, "{value:?}")
        };
    }
}

/// The count of thousandths `value` is, when it is a whole number of them below a
/// billion (the log lines' milliseconds to the microsecond); `None` for any other value.
/// Below 10^9 an f64 tells apart every two thousandths, so the digits that name the
/// thousandth are the shortest that read back as `value`, which is what `Debug` writes
/// ([`push_milli`]).
fn thousandths(value: f64) -> Option<u64> {
    let magnitude = value.abs();
    // NaN and the infinities fail this too.
    if !value.is_finite() || magnitude >= 1e9 {
        return None;
    }
    let scaled = (magnitude * 1000.0).round();
    if scaled / 1000.0 != magnitude {
        return None;
    }
    // In range by the check above: below 10^12.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Some(scaled as u64)
}

/// Appends `n` thousandths, negative when `negative`, as `Debug` writes the float
/// `n / 1000` (`-1.0`, `0.15`, `18.467`); any `u64` is written.
fn push_milli(out: &mut String, negative: bool, n: u64) {
    if negative {
        out.push('-');
    }
    push_decimal(out, n / 1000);
    out.push('.');
    // `Debug` writes the fewest digits of the fraction, and at least one.
    let fraction = n % 1000;
    let (hundreds, tens, ones) = (fraction / 100, fraction / 10 % 10, fraction % 10);
    out.push(digit(hundreds));
    if tens != 0 || ones != 0 {
        out.push(digit(tens));
    }
    if ones != 0 {
        out.push(digit(ones));
    }
}

/// The character of decimal digit `d` (below 10).
fn digit(d: u64) -> char {
    #[allow(clippy::cast_possible_truncation, reason = "a digit is below 10")]
    char::from(b'0' + d as u8)
}

/// Appends `value` in decimal (a log line's numbers are mostly a digit or two: those
/// are pushed without the buffer).
fn push_decimal(out: &mut String, value: u64) {
    if value < 10 {
        out.push(digit(value));
    } else if value < 100 {
        out.push(digit(value / 10));
        out.push(digit(value % 10));
    } else {
        // Written from the end of a buffer that holds any `u64`.
        let mut buf = [0u8; 20];
        let mut at = buf.len();
        let mut rest = value;
        while rest != 0 {
            at -= 1;
            #[allow(clippy::cast_possible_truncation, reason = "a digit is below 10")]
            let d = (rest % 10) as u8;
            buf[at] = b'0' + d;
            rest /= 10;
        }
        push_ascii(out, &buf[at..]);
    }
}

/// Appends ASCII `bytes` a character at a time: a log line's numbers are short, and
/// pushing their digits costs less than checking them as UTF-8 and copying them in.
fn push_ascii(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len());
    for &b in bytes {
        out.push(char::from(b));
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
mod tests;
