//! Plain aligned columns for the human output: a header row, then one row per item, each column
//! as wide as its widest cell, separated by two spaces; no trailing spaces.

/// A table under construction.
pub(crate) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub(crate) fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (as many cells as titles).
    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text, one line per row, each ending with a newline.
    pub(crate) fn render(&self) -> String {
        let columns = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate().take(columns) {
                if i > 0 {
                    line.push_str("  ");
                }
                line.push_str(cell);
                if i + 1 < columns {
                    let pad = widths[i] - cell.chars().count();
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Shard indexes as ranges: `[0, 1, 2, 5]` → `0-2,5`; empty → `-`.
pub(crate) fn shards(indexes: &[u32]) -> String {
    if indexes.is_empty() {
        return "-".to_owned();
    }
    let mut parts = Vec::new();
    let mut start = indexes[0];
    let mut end = start;
    for &i in &indexes[1..] {
        if i == end + 1 {
            end = i;
        } else {
            parts.push(range(start, end));
            start = i;
            end = i;
        }
    }
    parts.push(range(start, end));
    parts.join(",")
}

fn range(start: u32, end: u32) -> String {
    if start == end {
        start.to_string()
    } else {
        format!("{start}-{end}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_to_the_widest_cell() {
        let mut table = Table::new(&["SHARD", "STATE", "LAG"]);
        table.row(vec!["0".into(), "ACTIVE".into(), "12".into()]);
        table.row(vec!["10".into(), "DRAINING".into(), "unknown".into()]);
        assert_eq!(
            table.render(),
            "SHARD  STATE     LAG\n0      ACTIVE    12\n10     DRAINING  unknown\n"
        );
    }

    #[test]
    fn shard_lists_collapse_into_ranges() {
        assert_eq!(shards(&[]), "-");
        assert_eq!(shards(&[3]), "3");
        assert_eq!(shards(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
