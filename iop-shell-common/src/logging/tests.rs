//! Unit tests of `logging`.

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
            ttfb_ms = -1.0,
            ratio = 1.0 / 3.0,
            prompt_tokens = Some(17u64),
            r#type = "chat",
            lo = u64::MIN,
            hi = u64::MAX,
            neg = i64::MIN,
            pos = 42i64,
            "request"
        );
    };
    let ours = line(true, log);
    assert_eq!(
        ours,
        "request request_id=\"trace-4f1c\" caller=api_keys[0] node=\"n1\" status=200 \
         queue_ms=0.15 ttfb_ms=-1.0 ratio=0.3333333333333333 prompt_tokens=17 type=\"chat\" lo=0 hi=18446744073709551615 \
         neg=-9223372036854775808 pos=42"
    );
    assert_eq!(ours, line(false, log));
}

#[test]
fn whole_lines_read_as_the_default_format_writes_them() {
    let run = |ours: bool| {
        let capture = Capture::default();
        let sink = capture.clone();
        let builder = tracing_subscriber::fmt()
            .with_writer(move || sink.clone())
            .with_max_level(tracing::Level::TRACE)
            .without_time()
            .with_target(false)
            .with_ansi(false)
            .fmt_fields(TextFields);
        let log = || {
            tracing::error!(code = 3u64, "failed: \u{1b}[31m");
            tracing::warn!(peer = %"10.0.0.1:7100", "slow");
            let span = tracing::info_span!("conn", id = 7u64, name = "n1");
            let _in = span.enter();
            tracing::info!(status = 200u16, "request");
            let inner = tracing::debug_span!("bare");
            let _inner = inner.enter();
            tracing::trace!(ms = 0.25, "deep");
        };
        if ours {
            let subscriber = builder.event_format(TextLine { time: false }).finish();
            tracing::subscriber::with_default(subscriber, log);
        } else {
            tracing::subscriber::with_default(builder.finish(), log);
        }
        String::from_utf8(capture.0.lock().unwrap().clone()).unwrap()
    };
    let ours = run(true);
    assert_eq!(
        ours,
        "ERROR failed: \\u{1b}[31m code=3\n \
         WARN slow peer=10.0.0.1:7100\n \
         INFO conn{id=7 name=\"n1\"}: request status=200\n\
         TRACE conn{id=7 name=\"n1\"}:bare: deep ms=0.25\n"
    );
    assert_eq!(ours, run(false));
    // With the time: the stamp, then the level as the default pads it.
    let mut stamp = String::from("x");
    assert!(Clock::push_stamp(&mut stamp), "a clock after 1970");
    let stamp = stamp.split_off(1);
    let shape: String = stamp
        .chars()
        .map(|c| if c.is_ascii_digit() { '9' } else { c })
        .collect();
    assert_eq!(shape, "9999-99-99T99:99:99.999999Z", "{stamp}");
    // The second's text is kept: a second stamp in the same second starts the same.
    let mut again = String::new();
    assert!(Clock::push_stamp(&mut again));
    assert!(
        again[..17] == stamp[..17] || again > stamp,
        "{again} after {stamp}"
    );
}

/// `value` as the log writes a float it can write without the float's formatter.
fn as_thousandths(value: f64) -> Option<String> {
    let n = thousandths(value)?;
    let mut out = String::from("x");
    push_milli(&mut out, value.is_sign_negative(), n);
    Some(out.split_off(1))
}

#[test]
fn numbers_are_written_as_display_writes_them() {
    let mut values = vec![0, 1, 9, 10, 99, 100, 12_345, u64::MAX - 1, u64::MAX];
    values.extend((0..64).map(|bit| 1u64 << bit));
    values.extend((1..20).map(|exp| 10u64.pow(exp) - 1));
    for value in values {
        let mut out = String::from("n=");
        push_decimal(&mut out, value);
        assert_eq!(out, format!("n={value}"));
    }
    let mut out = String::new();
    push_milli(&mut out, true, u64::MAX);
    assert_eq!(out, format!("-{}.{}", u64::MAX / 1000, u64::MAX % 1000));
}

#[test]
fn thousandths_read_as_debug_writes_them() {
    let mut values = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.001,
        0.01,
        0.1,
        0.15,
        0.5,
        1.5,
        12.345,
        999.999,
        1000.0,
        123_456.789,
        999_999_999.999,
        1e9,
        1e12,
        1e16,
        1e-4,
        0.0005,
        1.0 / 3.0,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::MAX,
        f64::MIN_POSITIVE,
    ];
    // Every microsecond count a log line gives as milliseconds, spread over 2^40.
    let mut micros = 1u64;
    while micros < 1 << 40 {
        for n in [micros, micros + 7, micros * 3 + 1] {
            values.push(n as f64 / 1e3);
        }
        micros = micros * 5 / 4 + 1;
    }
    for value in values {
        let debug = format!("{value:?}");
        if let Some(text) = as_thousandths(value) {
            assert_eq!(text, debug, "{value}");
        } else {
            assert!(
                !value.is_finite() || value.abs() >= 1e9 || (value * 1e3).fract() != 0.0,
                "{debug}"
            );
        }
    }
    assert_eq!(as_thousandths(2.5).as_deref(), Some("2.5"));
    assert_eq!(as_thousandths(1.0 / 3.0), None);
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
fn timestamps_read_as_rfc_3339_utc_with_microseconds() {
    let at = |secs| String::from_utf8(second_prefix(secs).unwrap().to_vec()).unwrap();
    assert_eq!(at(0), "1970-01-01T00:00:00.");
    // A leap day, the last second of a day, and a century that is not a leap year.
    assert_eq!(at(951_782_400), "2000-02-29T00:00:00.");
    assert_eq!(at(1_764_633_599), "2025-12-01T23:59:59.");
    assert_eq!(at(4_107_542_400), "2100-03-01T00:00:00.");
    assert_eq!(at(253_402_300_799), "9999-12-31T23:59:59.");
    assert_eq!(second_prefix(253_402_300_800), None);
    // The clock's line agrees with tracing-subscriber's own to the second.
    let mut ours = String::new();
    let mut theirs = String::new();
    use tracing_subscriber::fmt::time::FormatTime;
    for _ in 0..3 {
        ours.clear();
        theirs.clear();
        Clock
            .format_time(&mut tracing_subscriber::fmt::format::Writer::new(&mut ours))
            .unwrap();
        tracing_subscriber::fmt::time::SystemTime
            .format_time(&mut tracing_subscriber::fmt::format::Writer::new(
                &mut theirs,
            ))
            .unwrap();
        if ours[..19] == theirs[..19] {
            break;
        }
    }
    assert_eq!(ours.len(), theirs.len());
    assert_eq!(ours[..19], theirs[..19]);
    assert!(ours.ends_with('Z') && ours.as_bytes()[19] == b'.');
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

#[test]
fn direct_lines_read_as_the_text_format_writes_the_same_event() {
    let caller = "api_keys[0]";
    let none: Option<&str> = None;
    let log = || {
        tracing::info!(
            request_id = "req_1",
            endpoint = "/v1/chat/completions",
            trace_id = none,
            caller = %caller,
            odd = "a \"quoted\" \\ and \u{7}",
            status = 200u16,
            queue_ms = Some(0.15),
            missing_ms = -1.0,
            small_ms = 0.007,
            whole_ms = 12.0,
            long_ms = 123_456.789,
            prompt_tokens = Some(17u64),
            completion_tokens = None::<u64>,
            "request"
        );
    };
    let mut direct = String::new();
    let fields = crate::direct_line!(
        "request",
        request_id: Some(Field::Str("req_1")),
        endpoint: Some(Field::Quoted("/v1/chat/completions")),
        trace_id: none.map(Field::Str),
        caller: Some(Field::Bare(caller)),
        odd: Some(Field::Str("a \"quoted\" \\ and \u{7}")),
        status: Some(Field::U64(200)),
        queue_ms: Some(Field::Milli(150)),
        missing_ms: Some(Field::Milli(-1000)),
        small_ms: Some(Field::Milli(7)),
        whole_ms: Some(Field::Milli(12_000)),
        long_ms: Some(Field::Milli(123_456_789)),
        prompt_tokens: Some(Field::U64(17)),
        completion_tokens: None,
    );
    write_fields(&mut direct, &fields).unwrap();
    assert_eq!(direct, line(true, log));
    assert_eq!(direct, line(false, log));
    // Not installed here: the caller logs through tracing.
    assert!(!info_direct(&crate::direct_line!("request")));
}

#[test]
fn the_eight_at_a_time_check_reads_every_byte_as_the_byte_by_byte_one() {
    let bytewise = |bytes: &[u8]| {
        bytes
            .iter()
            .all(|&b| (b' '..0x7f).contains(&b) && b != b'"' && b != b'\\')
    };
    // Every byte value at every place of the first and second word and the remainder.
    for len in [1, 7, 8, 9, 16, 17, 23] {
        for at in 0..len {
            for byte in 0..=u8::MAX {
                let mut text = vec![b'a'; len];
                text[at] = byte;
                assert_eq!(
                    plain_ascii(&text),
                    bytewise(&text),
                    "byte {byte:#04x} at {at} of {len}"
                );
            }
        }
    }
    // Neighbours of the bounds beside each other, where a borrow between bytes could
    // hide one.
    for pair in [
        [0x1f, 0x20],
        [0x20, 0x1f],
        [0x7e, 0x7f],
        [0x00, 0x21],
        [0x21, 0x00],
    ] {
        let mut text = [b' '; 16];
        text[3..5].copy_from_slice(&pair);
        assert_eq!(plain_ascii(&text), bytewise(&text), "{pair:?}");
    }
    assert!(plain_ascii(b""));
    assert!(plain_ascii(b"req_0123456789abcdef01234567 ~!"));
}
