//! Untrusted text in errors and logs: the one place that decides how it is shown.
//!
//! A request value, an annotation key or value, a container id or a path from a config
//! is written by whoever wrote the container's config. Put raw into a message, a newline
//! forges a second log line, ESC and NUL reach an operator's terminal, and a 100 KB value
//! makes a 100 KB line. [`untrusted`] shows such text with every control character (and
//! every invisible character that reorders or hides text: bidi overrides, zero-width
//! characters, line and paragraph separators) escaped as `\n`, `\t`, `\r`, `\0` or
//! `\u{..}`, cut to [`MAX_UNTRUSTED_CHARS`] characters with a marker giving the full length.
//!
//! Backslashes are not escaped: showing text twice (a field, then the line it is part of)
//! changes nothing the second time, and no escape can produce a control character.
//!
//! Text written into a CSV cell goes through [`csv_cell`], the one CSV cell writer: a
//! spreadsheet runs a cell that starts with `=`, `+`, `-`, `@`, a tab or a CR as a formula.

use std::borrow::Cow;
use std::fmt;

/// The characters that make a spreadsheet read a cell as a formula when one starts it
/// (OWASP, "CSV Injection").
pub const CSV_FORMULA_STARTS: [char; 6] = ['=', '+', '-', '@', '\t', '\r'];

/// `text` as one CSV cell (RFC 4180) that no spreadsheet runs: a cell starting with one
/// of [`CSV_FORMULA_STARTS`] gets a leading `'` (shown as text, and the text is all there
/// after it), and a cell holding that prefix, a `,`, a `"`, a CR or a LF is quoted with
/// every `"` doubled. Anything else is written as it is.
pub fn csv_cell(text: &str) -> Cow<'_, str> {
    let formula = text.starts_with(CSV_FORMULA_STARTS);
    if !formula && !text.contains([',', '"', '\n', '\r']) {
        return Cow::Borrowed(text);
    }
    let mut cell = String::with_capacity(text.len() + 4);
    cell.push('"');
    if formula {
        cell.push('\'');
    }
    cell.push_str(&text.replace('"', "\"\""));
    cell.push('"');
    Cow::Owned(cell)
}

/// How many characters of one untrusted value a message shows.
pub const MAX_UNTRUSTED_CHARS: usize = 256;

/// How many characters one whole error line may have (a message built from several
/// untrusted values and fixed text).
pub const MAX_LINE_CHARS: usize = 4096;

/// `text` for a message: control and invisible characters escaped, at most
/// [`MAX_UNTRUSTED_CHARS`] characters (then `…[N bytes in all]`).
pub fn untrusted(text: &str) -> Untrusted<'_> {
    Untrusted { text, max_chars: MAX_UNTRUSTED_CHARS }
}

/// How [`untrusted`] text is displayed; see the module documentation.
#[derive(Debug, Clone, Copy)]
pub struct Untrusted<'a> {
    text: &'a str,
    max_chars: usize,
}

impl Untrusted<'_> {
    /// Show at most `max_chars` characters instead (escapes count at their shown length).
    pub fn max_chars(self, max_chars: usize) -> Self {
        Untrusted { max_chars, ..self }
    }
}

/// Whether `c` is shown escaped.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{2064}'
                | '\u{2066}'..='\u{2069}'
                | '\u{FEFF}'
        )
}

fn escape(c: char, buf: &mut String) {
    buf.clear();
    match c {
        '\n' => buf.push_str("\\n"),
        '\r' => buf.push_str("\\r"),
        '\t' => buf.push_str("\\t"),
        '\0' => buf.push_str("\\0"),
        c if needs_escape(c) => {
            use fmt::Write;
            let _ = write!(buf, "\\u{{{:x}}}", c as u32);
        }
        c => buf.push(c),
    }
}

impl fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = 0;
        let mut piece = String::with_capacity(12);
        for c in self.text.chars() {
            escape(c, &mut piece);
            let n = piece.chars().count();
            if shown + n > self.max_chars {
                return write!(f, "…[{} bytes in all]", self.text.len());
            }
            f.write_str(&piece)?;
            shown += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_unchanged() {
        for s in ["gpu=1", "mig=1g.10gb", "/run/containerd/k8s.io/abc", "équipe-α", "a\\nb", ""] {
            assert_eq!(untrusted(s).to_string(), s);
        }
    }

    #[test]
    fn control_and_invisible_characters_are_escaped() {
        assert_eq!(untrusted("a\nb\r\tc\0").to_string(), "a\\nb\\r\\tc\\0");
        assert_eq!(untrusted("\u{1b}[2J").to_string(), "\\u{1b}[2J");
        assert_eq!(untrusted("\u{7f}\u{85}\u{9b}").to_string(), "\\u{7f}\\u{85}\\u{9b}");
        assert_eq!(
            untrusted("x\u{202e}y\u{2028}z\u{200b}").to_string(),
            "x\\u{202e}y\\u{2028}z\\u{200b}"
        );
        let shown = untrusted("line\nlevel=error msg=forged").to_string();
        assert_eq!(shown.lines().count(), 1);
    }

    #[test]
    fn long_text_is_cut_with_its_length() {
        let long = "x".repeat(100_000);
        let shown = untrusted(&long).to_string();
        assert!(shown.starts_with(&"x".repeat(MAX_UNTRUSTED_CHARS)), "{shown}");
        assert!(shown.ends_with("…[100000 bytes in all]"), "{shown}");
        assert!(shown.chars().count() < MAX_UNTRUSTED_CHARS + 30);
        // Exactly at the bound: whole, no marker.
        let at = "y".repeat(MAX_UNTRUSTED_CHARS);
        assert_eq!(untrusted(&at).to_string(), at);
        // Escapes count at their shown length, so the bound holds for the escaped text.
        let nl = "\n".repeat(1000);
        let shown = untrusted(&nl).to_string();
        assert!(shown.chars().count() <= MAX_UNTRUSTED_CHARS + 30, "{}", shown.len());
        assert!(!shown.contains('\n'));
        assert_eq!(untrusted("abcdef").max_chars(3).to_string(), "abc…[6 bytes in all]");
    }

    #[test]
    fn csv_cells_never_start_a_formula() {
        let cases = [
            ("=cmd|' /C calc'!A0", "\"'=cmd|' /C calc'!A0\""),
            ("+cmd|' /C calc'!A0", "\"'+cmd|' /C calc'!A0\""),
            ("-2+3+cmd|' /C calc'!A0", "\"'-2+3+cmd|' /C calc'!A0\""),
            ("@SUM(1+1)*cmd|' /C calc'!A0", "\"'@SUM(1+1)*cmd|' /C calc'!A0\""),
            ("\t=1+1", "\"'\t=1+1\""),
            ("\r=1+1", "\"'\r=1+1\""),
            ("=\"a\",b", "\"'=\"\"a\"\",b\""),
            ("-", "\"'-\""),
        ];
        for (text, cell) in cases {
            assert_eq!(csv_cell(text), cell, "{text:?}");
            assert!(!csv_cell(text).starts_with(CSV_FORMULA_STARTS), "{text:?}");
        }
        // Plain cells are as they were; cells that need quoting only are quoted.
        for plain in ["acme/ml/cv", "team-a/trainer", "c1", "TOTAL", "", "a=b", "x-1"] {
            assert_eq!(csv_cell(plain), plain);
        }
        assert_eq!(csv_cell("a,b"), "\"a,b\"");
        assert_eq!(csv_cell("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_cell("two\nlines"), "\"two\nlines\"");
    }

    #[test]
    fn showing_twice_changes_nothing() {
        let hostile = "a\nb\u{1b}c\\u{1b}\u{0}";
        let once = untrusted(hostile).to_string();
        assert_eq!(untrusted(&once).to_string(), once);
    }
}
