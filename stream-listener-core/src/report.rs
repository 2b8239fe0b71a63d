//! Printing an error with its causes. Every error of this crate keeps its cause as its
//! `source()`, not in its message (docs/design.md §8.14), so a log line or a command-line message
//! that shows only `to_string()` loses it: [`Chain`] prints the whole chain.

use std::error::Error;
use std::fmt;

/// Displays an error and its sources, `: `-separated (`Redis command failed; ...: Connection
/// refused (os error 111)`). A source whose text the message before it already holds is left
/// out (redis-rs's errors repeat their own server error as their source).
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = self.0.to_string();
        f.write_str(&last)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !last.contains(&text) {
                write!(f, ": {text}")?;
                last = text;
            }
            source = cause.source();
        }
        Ok(())
    }
}

/// Writes `error` as its `Debug`: its message, then each cause, as [`Chain`] displays it. The
/// one implementation of the public errors' `Debug` (docs/design.md §14.5): `fn main() ->
/// Result<(), E>` prints an error's `Debug`, and a struct dump there says less than the message
/// with its causes. For an error type outside this crate, call it from its `Debug` impl.
///
/// # Errors
/// Only the formatter's.
pub fn debug_chain(error: &(dyn Error + 'static), f: &mut fmt::Formatter<'_>) -> fmt::Result {
    fmt::Display::fmt(&Chain(error), f)
}

/// Implements `Debug` for each error type named as [`debug_chain`] (its message, then each
/// cause), instead of the derive's struct dump.
macro_rules! readable_debug {
    ($($error:ty),* $(,)?) => {$(
        impl ::std::fmt::Debug for $error {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                $crate::report::debug_chain(self, f)
            }
        }
    )*};
}
pub(crate) use readable_debug;

/// The text of a caught panic's payload (a `&str` or `String` message), for logs and dead
/// letters.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer failed; retry")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn prints_each_cause_once() {
        let error = Outer(std::io::Error::other("disk full"));
        assert_eq!(Chain(&error).to_string(), "outer failed; retry: disk full");
        let redis =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let text = Chain(&redis).to_string();
        assert_eq!(text, redis.to_string(), "{text}");
    }
}
