//! Reading the scripts' and `XREADGROUP`'s replies into entries.

use std::sync::Arc;

use redis::Value;

use crate::dataplane::error::DataPlaneError;
use crate::dataplane::{EntryStatus, ShardEntry};
use crate::model::ShardIndex;

/// A string reply element.
pub(super) fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Okay => Some("OK".to_owned()),
        _ => None,
    }
}

/// A string reply element taken by value: no copy for valid UTF-8 (ids and field names, per
/// entry on the hot path).
pub(super) fn into_text(value: Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(
            String::from_utf8(bytes)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
        ),
        Value::SimpleString(s) => Some(s),
        other => text(&other),
    }
}

/// An integer reply element (Lua numbers arrive as integers).
pub(super) fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?.parse().ok(),
        _ => None,
    }
}

/// The entry list of a one-stream `XREADGROUP` reply: `[[key, entries]]` (RESP2) or
/// `{key: entries}` (RESP3); `None` for a nil reply (nothing new).
pub(super) fn single_stream_entries(reply: Value) -> Option<Value> {
    match reply {
        Value::Array(streams) => match streams.into_iter().next()? {
            Value::Array(pair) => pair.into_iter().nth(1),
            _ => None,
        },
        Value::Map(streams) => streams.into_iter().next().map(|(_, entries)| entries),
        _ => None,
    }
}

/// Drops the fields of an entry whose names and values total more than `max` bytes and marks it
/// [`EntryStatus::TooLarge`] (what the scripts do in Redis, done after a plain read).
pub(super) fn withhold_if_larger(entry: &mut ShardEntry, max: u64) {
    let bytes: usize = entry
        .fields
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    let bytes = bytes as u64;
    if bytes > max {
        entry.fields = Arc::default();
        entry.status = EntryStatus::TooLarge { bytes };
    }
}

/// Whether `pair` is a field name (a string: not UTF-8 is read lossily) and a value (a string
/// or an integer) of an entry body.
pub(super) fn is_field_pair(pair: &[Value]) -> bool {
    matches!(pair[0], Value::BulkString(_) | Value::SimpleString(_))
        && matches!(
            pair[1],
            Value::BulkString(_) | Value::SimpleString(_) | Value::Int(_)
        )
}

/// A field value checked by [`is_field_pair`], taken by value.
pub(super) fn into_bytes(value: Value) -> Vec<u8> {
    match value {
        Value::BulkString(bytes) => bytes,
        Value::SimpleString(s) => s.into_bytes(),
        Value::Int(n) => n.to_string().into_bytes(),
        _ => Vec::new(),
    }
}

/// Parses the scripts' entry list: `{{id, body[, deliveryCount]}, ...}` where body is the
/// field/value list, nil (trimmed) or the size in bytes (too large).
pub(super) fn parse_entries(
    op: &'static str,
    shard: ShardIndex,
    value: Value,
    with_counts: bool,
) -> Result<Vec<ShardEntry>, DataPlaneError> {
    let bad = |what: String| DataPlaneError::unexpected(op, Some(shard), what);
    let list = match value {
        Value::Array(list) => list,
        other => return Err(bad(format!("entry list {other:?}"))),
    };
    let mut entries = Vec::with_capacity(list.len());
    for item in list {
        let Value::Array(mut parts) = item else {
            return Err(bad(format!("entry {item:?}")));
        };
        if parts.len() < 2 {
            parts.resize(2, Value::Nil);
        }
        let id = match std::mem::take(&mut parts[0]) {
            Value::Nil => return Err(bad("entry id nil".into())),
            raw => into_text(raw).ok_or_else(|| bad("entry id".into()))?,
        };
        let delivery_count = if with_counts {
            parts
                .get(2)
                .and_then(int)
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| bad(format!("delivery count of {id}")))?
        } else {
            1
        };
        let (fields, status) = match std::mem::take(&mut parts[1]) {
            Value::Nil => (Arc::default(), EntryStatus::Trimmed),
            Value::Int(bytes) => (
                Arc::default(),
                EntryStatus::TooLarge {
                    bytes: u64::try_from(bytes).unwrap_or(0),
                },
            ),
            Value::Array(mut flat) if flat.len() % 2 == 0 => {
                if let Some(pair) = flat.chunks_exact(2).find(|pair| !is_field_pair(pair)) {
                    return Err(bad(format!("field of {id}: {pair:?}")));
                }
                // Straight into the shared slice every attempt's `Delivery` gets (one
                // allocation: the iterator has an exact length).
                let fields: Arc<[(String, Vec<u8>)]> = flat
                    .chunks_exact_mut(2)
                    .map(|pair| {
                        let name = into_text(std::mem::take(&mut pair[0])).unwrap_or_default();
                        (name, into_bytes(std::mem::take(&mut pair[1])))
                    })
                    .collect();
                (fields, EntryStatus::Present)
            }
            other => return Err(bad(format!("body of {id}: {other:?}"))),
        };
        entries.push(ShardEntry {
            id,
            fields,
            delivery_count,
            status,
        });
    }
    Ok(entries)
}
