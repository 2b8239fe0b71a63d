//! The log lines of the test process, captured: one global `tracing` subscriber (plain text, no
//! colours) writing into a [`LogBuffer`] the test reads back.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// Every line the subscriber wrote. Clones share the lines.
#[derive(Clone, Default)]
pub struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    /// Everything written so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Everything written so far, line by line.
    pub fn lines(&self) -> Vec<String> {
        self.text().lines().map(str::to_owned).collect()
    }
}

impl Write for LogBuffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A subscriber of events up to `level` writing into the returned buffer, for
/// `tracing::subscriber::set_default` (this thread) or [`capture`] (the process).
pub fn subscriber(level: tracing::Level) -> (LogBuffer, impl tracing::Subscriber + Send + Sync) {
    let buffer = LogBuffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(level)
        .with_writer(move || writer.clone())
        .finish();
    (buffer, subscriber)
}

/// Installs the process's global subscriber, events up to `level`, writing into the returned
/// buffer. Panics when a global subscriber is set already (once per test binary).
pub fn capture(level: tracing::Level) -> LogBuffer {
    let (buffer, subscriber) = subscriber(level);
    tracing::subscriber::set_global_default(subscriber).unwrap();
    buffer
}
