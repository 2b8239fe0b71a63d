//! From byte offsets in a TOML document to lines, columns and dotted key paths, and back.

use std::ops::Range;

use toml::de::{DeTable, DeValue};

use super::error::Location;

/// 1-based line and column (in characters) of byte `offset` of `text`.
pub(super) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = text[line_start..offset].chars().count() + 1;
    (line, column)
}

/// A dotted key path, each segment quoted when it is not a bare TOML key.
pub(super) fn dotted(path: &[String]) -> String {
    path.iter()
        .map(|segment| {
            let bare = !segment.is_empty()
                && segment
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if bare {
                segment.clone()
            } else {
                format!("{segment:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

fn contains(span: &Range<usize>, offset: usize) -> bool {
    span.start <= offset && offset < span.end.max(span.start + 1)
}

/// The deepest key whose name or value covers byte `offset`, as a path of segments.
pub(super) fn key_at(text: &str, offset: usize) -> Option<Vec<String>> {
    let document = DeTable::parse(text).ok()?;
    find_in_table(document.get_ref(), offset)
}

fn find_in_table(table: &DeTable<'_>, offset: usize) -> Option<Vec<String>> {
    for (key, value) in table.iter() {
        let name = key.get_ref().to_string();
        if let Some(mut deeper) = find_in_value(value.get_ref(), offset) {
            deeper.insert(0, name);
            return Some(deeper);
        }
        if contains(&key.span(), offset) || contains(&value.span(), offset) {
            return Some(vec![name]);
        }
    }
    None
}

fn find_in_value(value: &DeValue<'_>, offset: usize) -> Option<Vec<String>> {
    match value {
        DeValue::Table(table) => find_in_table(table, offset),
        DeValue::Array(items) => items
            .iter()
            .find_map(|item| find_in_value(item.get_ref(), offset)),
        _ => None,
    }
}

/// Where the key at `path` is written (its name), if the document has it.
pub(super) fn locate_key(file: &str, text: &str, path: &[&str]) -> Option<Location> {
    let document = DeTable::parse(text).ok()?;
    let mut table = document.get_ref();
    let mut span = None;
    for (i, segment) in path.iter().enumerate() {
        let (key, value) = table
            .iter()
            .find(|(k, _)| k.get_ref().as_ref() == *segment)?;
        span = Some(key.span());
        if i + 1 < path.len() {
            table = value.get_ref().as_table()?;
        }
    }
    let (line, column) = line_column(text, span?.start);
    Some(Location {
        file: file.to_owned(),
        line,
        column,
    })
}

/// For a syntax error, where no document could be parsed: the key written on the error's line
/// (text before `=`), under the nearest table header above it.
pub(super) fn key_on_line(text: &str, offset: usize) -> Option<String> {
    let (line, _) = line_column(text, offset);
    let lines: Vec<&str> = text.lines().collect();
    let current = lines.get(line - 1)?;
    let (key, _) = current.split_once('=')?;
    let key = key.trim();
    if key.is_empty() || key.starts_with('#') || key.starts_with('[') {
        return None;
    }
    let header = lines[..line - 1].iter().rev().find_map(|l| {
        let l = l.trim();
        let inner = l.strip_prefix('[')?;
        let inner = inner.strip_prefix('[').unwrap_or(inner);
        let end = inner.find(']')?;
        Some(inner[..end].trim().to_owned())
    });
    Some(match header {
        Some(header) if !header.is_empty() => format!("{header}.{key}"),
        _ => key.to_owned(),
    })
}
