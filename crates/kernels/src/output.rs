//! A cell's output as the model reads it: capped, and plain text.

/// A cell's output, kept up to a limit in bytes; what comes after is counted, not kept.
#[derive(Debug)]
pub(crate) struct Output {
    text: String,
    limit: usize,
    /// Bytes not kept. Once anything is cut, everything after is counted too, so that the
    /// kept text is a prefix of the whole.
    more: u64,
}

impl Output {
    pub(crate) fn new(limit: usize) -> Output {
        Output {
            text: String::new(),
            limit,
            more: 0,
        }
    }

    pub(crate) fn push(&mut self, s: &str) {
        if self.more > 0 {
            self.more += s.len() as u64;
            return;
        }
        let room = self.limit.saturating_sub(self.text.len());
        if s.len() <= room {
            self.text.push_str(s);
            return;
        }
        let mut cut = room;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        self.text.push_str(&s[..cut]);
        self.more = (s.len() - cut) as u64;
    }

    /// The text, saying how much was cut, as the local interpreter does.
    pub(crate) fn finish(mut self) -> String {
        if self.more > 0 {
            self.text
                .push_str(&format!("\n[output truncated: {} more bytes]", self.more));
        }
        self.text
    }
}

/// `text` without its ANSI escape sequences (IPython colours its tracebacks): CSI sequences
/// (`ESC [ … final`), OSC sequences (`ESC ] … BEL` or `ESC ] … ESC \`) and two-byte escapes.
pub(crate) fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('[') => {
                // Parameters and intermediates, then one final byte in @..=~.
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            Some(']') => {
                while let Some(c) = chars.next() {
                    if c == '\u{7}' {
                        break;
                    }
                    if c == '\u{1b}' && chars.peek() == Some(&'\\') {
                        chars.next();
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_cut_at_the_limit_and_counted() {
        let mut output = Output::new(5);
        output.push("abc");
        output.push("defg");
        output.push("h");
        assert_eq!(output.finish(), "abcde\n[output truncated: 3 more bytes]");
    }

    #[test]
    fn output_is_cut_at_a_character_boundary() {
        let mut output = Output::new(2);
        output.push("aé");
        output.push("b");
        assert_eq!(output.finish(), "a\n[output truncated: 3 more bytes]");
    }

    #[test]
    fn output_within_the_limit_is_whole() {
        let mut output = Output::new(3);
        output.push("abc");
        assert_eq!(output.finish(), "abc");
    }

    #[test]
    fn ansi_sequences_are_stripped() {
        assert_eq!(
            strip_ansi("\u{1b}[31mZeroDivisionError\u{1b}[39m: x\u{1b}[0;32m!"),
            "ZeroDivisionError: x!"
        );
        assert_eq!(
            strip_ansi("a\u{1b}]8;;http://x\u{7}b\u{1b}]0;t\u{1b}\\c"),
            "abc"
        );
        assert_eq!(strip_ansi("end\u{1b}"), "end");
        assert_eq!(strip_ansi("end\u{1b}[1;"), "end");
    }
}
