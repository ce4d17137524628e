//! `calculator`: arithmetic expressions, evaluated exactly as written (no code runs).

use serde_json::{Value, json};

use crate::tool::{Arguments, ToolError};

/// How deeply an expression may nest: parentheses, function calls, signs (`--1`) and the
/// right-hand sides of `^` each take one level. The parser recurses once per level, and the
/// expression is the model's: past this many levels it is an [`ExpressionError`], not a
/// stack overflow that would abort the process (a tool runs on a pool thread of 2 MiB).
pub const MAX_EXPRESSION_DEPTH: usize = 100;

/// Evaluates `expression`: numbers (`12`, `3.5`, `1e3`), `+ - * / %`, `^` or `**` (power,
/// right-associative), parentheses, unary minus, the constants `pi` and `e`, and `sqrt`,
/// `abs`, `round`, `floor`, `ceil`, `ln`, `log10`, nested at most [`MAX_EXPRESSION_DEPTH`] levels. An
/// error says where the expression stops making sense.
pub fn evaluate(expression: &str) -> Result<f64, ExpressionError> {
    evaluate_text(expression).map_err(ExpressionError)
}

/// Why an expression has no value: where it stops making sense, or what its value is not.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ExpressionError(String);

fn evaluate_text(expression: &str) -> Result<f64, String> {
    let mut parser = Parser {
        text: expression.as_bytes(),
        at: 0,
        depth: 0,
    };
    let value = parser.sum()?;
    parser.space();
    if parser.at < parser.text.len() {
        return Err(parser.error("an operator or the end of the expression"));
    }
    if !value.is_finite() {
        return Err("the result is not a finite number".to_owned());
    }
    Ok(value)
}

/// The `calculator` tool: `{"expression": "17 * 23"}` answers `391`.
pub(crate) fn call(args: Arguments) -> Result<Value, ToolError> {
    let expression = args
        .get("expression")
        .and_then(Value::as_str)
        .ok_or("the calculator needs {\"expression\": \"...\"}")?;
    let value = evaluate(expression)?;
    Ok(json!(format_number(value)))
}

/// Integers without a fractional part (`391`, not `391.0`); other values as they are.
pub(crate) fn format_number(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{}", value as i64)
    } else {
        format!("{value}")
    }
}

pub(crate) fn parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "expression": { "type": "string", "description": "An arithmetic expression, e.g. (17 + 3) * 2 / 5" }
        },
        "required": ["expression"]
    })
}

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
    /// Levels entered through [`Parser::nested`], at most [`MAX_EXPRESSION_DEPTH`].
    depth: usize,
}

impl Parser<'_> {
    fn space(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.text.get(self.at).copied()
    }

    fn error(&self, expected: &str) -> String {
        match self.text.get(self.at) {
            Some(c) => format!(
                "expected {expected} at position {} but found '{}'",
                self.at + 1,
                *c as char
            ),
            None => format!("expected {expected} at the end of the expression"),
        }
    }

    /// Runs `parse` one level deeper: every recursion of the parser goes through here, so
    /// that its depth is bounded by [`MAX_EXPRESSION_DEPTH`] whatever the text.
    fn nested(
        &mut self,
        parse: impl FnOnce(&mut Self) -> Result<f64, String>,
    ) -> Result<f64, String> {
        if self.depth >= MAX_EXPRESSION_DEPTH {
            return Err(format!(
                "expression nested deeper than {MAX_EXPRESSION_DEPTH} levels at position {}; \
                 split it into smaller calculations",
                self.at + 1
            ));
        }
        self.depth += 1;
        let value = parse(self);
        self.depth -= 1;
        value
    }

    fn sum(&mut self) -> Result<f64, String> {
        let mut value = self.product()?;
        loop {
            match self.peek() {
                Some(b'+') => {
                    self.at += 1;
                    value += self.product()?;
                }
                Some(b'-') => {
                    self.at += 1;
                    value -= self.product()?;
                }
                _ => return Ok(value),
            }
        }
    }

    fn product(&mut self) -> Result<f64, String> {
        let mut value = self.power()?;
        loop {
            match self.peek() {
                Some(b'*') if self.text.get(self.at + 1) != Some(&b'*') => {
                    self.at += 1;
                    value *= self.power()?;
                }
                Some(op @ (b'/' | b'%')) => {
                    self.at += 1;
                    let divisor = self.power()?;
                    if divisor == 0.0 {
                        return Err("division by zero".to_owned());
                    }
                    value = if op == b'/' {
                        value / divisor
                    } else {
                        value % divisor
                    };
                }
                _ => return Ok(value),
            }
        }
    }

    fn power(&mut self) -> Result<f64, String> {
        let base = self.unary()?;
        let is_power = match self.peek() {
            Some(b'^') => {
                self.at += 1;
                true
            }
            Some(b'*') if self.text.get(self.at + 1) == Some(&b'*') => {
                self.at += 2;
                true
            }
            _ => false,
        };
        if is_power {
            Ok(base.powf(self.nested(Self::power)?))
        } else {
            Ok(base)
        }
    }

    fn unary(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some(b'-') => {
                self.at += 1;
                Ok(-self.nested(Self::unary)?)
            }
            Some(b'+') => {
                self.at += 1;
                self.nested(Self::unary)
            }
            _ => self.atom(),
        }
    }

    fn atom(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some(b'(') => {
                self.at += 1;
                let value = self.nested(Self::sum)?;
                if self.peek() != Some(b')') {
                    return Err(self.error("')'"));
                }
                self.at += 1;
                Ok(value)
            }
            Some(c) if c.is_ascii_digit() || c == b'.' => self.number(),
            Some(c) if c.is_ascii_alphabetic() => self.name(),
            _ => Err(self.error("a number, '(' or a function")),
        }
    }

    fn number(&mut self) -> Result<f64, String> {
        let start = self.at;
        while self
            .text
            .get(self.at)
            .is_some_and(|c| c.is_ascii_digit() || *c == b'.' || *c == b'_')
        {
            self.at += 1;
        }
        if matches!(self.text.get(self.at), Some(b'e' | b'E'))
            && self
                .text
                .get(self.at + 1)
                .is_some_and(|c| c.is_ascii_digit() || *c == b'-' || *c == b'+')
        {
            self.at += 2;
            while self.text.get(self.at).is_some_and(u8::is_ascii_digit) {
                self.at += 1;
            }
        }
        let text: String = String::from_utf8_lossy(&self.text[start..self.at]).replace('_', "");
        text.parse()
            .map_err(|_| format!("'{text}' at position {} is not a number", start + 1))
    }

    fn name(&mut self) -> Result<f64, String> {
        let start = self.at;
        while self
            .text
            .get(self.at)
            .is_some_and(|c| c.is_ascii_alphanumeric())
        {
            self.at += 1;
        }
        let name = String::from_utf8_lossy(&self.text[start..self.at]).to_lowercase();
        let function: fn(f64) -> f64 = match name.as_str() {
            "pi" => return Ok(std::f64::consts::PI),
            "e" => return Ok(std::f64::consts::E),
            "sqrt" => f64::sqrt,
            "abs" => f64::abs,
            "round" => f64::round,
            "floor" => f64::floor,
            "ceil" => f64::ceil,
            "ln" => f64::ln,
            "log10" => f64::log10,
            other => {
                return Err(format!(
                    "unknown name '{other}' at position {}; known: pi, e, sqrt, abs, round, floor, ceil, ln, log10",
                    start + 1
                ));
            }
        };
        if self.peek() != Some(b'(') {
            return Err(self.error(&format!("'(' after {name}")));
        }
        self.at += 1;
        let argument = self.nested(Self::sum)?;
        if self.peek() != Some(b')') {
            return Err(self.error("')'"));
        }
        self.at += 1;
        Ok(function(argument))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_follows_the_usual_precedence() {
        let cases = [
            ("17 * 23", 391.0),
            ("2 + 3 * 4", 14.0),
            ("(2 + 3) * 4", 20.0),
            ("2 ^ 3 ^ 2", 512.0),
            ("2 ** 10", 1024.0),
            ("-3 ^ 2", 9.0),
            ("10 / 4", 2.5),
            ("10 % 4", 2.0),
            ("1e3 + 1_000", 2000.0),
            ("sqrt(16) + abs(-2)", 6.0),
            ("round(2.5) + floor(1.9) + ceil(0.1)", 5.0),
        ];
        for (expression, expected) in cases {
            assert_eq!(evaluate(expression), Ok(expected), "{expression}");
        }
        assert!((evaluate("2 * pi").unwrap_or_default() - std::f64::consts::TAU).abs() < 1e-12);
    }

    #[test]
    fn errors_say_where_and_what_was_expected() {
        assert_eq!(evaluate_text("1 / 0"), Err("division by zero".to_owned()));
        assert_eq!(
            evaluate_text("2 +"),
            Err("expected a number, '(' or a function at the end of the expression".to_owned())
        );
        assert_eq!(
            evaluate_text("(1 + 2"),
            Err("expected ')' at the end of the expression".to_owned())
        );
        assert_eq!(
            evaluate_text("3 $ 4"),
            Err(
                "expected an operator or the end of the expression at position 3 but found '$'"
                    .to_owned()
            )
        );
        assert!(
            evaluate_text("import os")
                .is_err_and(|e| e.starts_with("unknown name 'import' at position 1"))
        );
        assert_eq!(
            evaluate_text("10 ^ 400"),
            Err("the result is not a finite number".to_owned())
        );
    }

    /// Evaluates `expression` on a thread with the tool pool's 2 MiB stack; a stack overflow
    /// there aborts the test binary.
    fn evaluate_on_a_pool_sized_stack(expression: String) -> Result<f64, String> {
        std::thread::Builder::new()
            .stack_size(2 * 1024 * 1024)
            .spawn(move || evaluate_text(&expression))
            .map_err(|e| format!("cannot start a thread: {e}"))?
            .join()
            .map_err(|_| "the evaluating thread panicked".to_owned())?
    }

    fn nested_too_deep(result: &Result<f64, String>) -> bool {
        result.as_ref().is_err_and(|e| {
            e.starts_with(&format!(
                "expression nested deeper than {MAX_EXPRESSION_DEPTH} levels"
            ))
        })
    }

    #[test]
    fn deeply_nested_parentheses_are_an_error_not_a_stack_overflow() {
        let deep = format!("{}1{}", "(".repeat(20_000), ")".repeat(20_000));
        let result = evaluate_on_a_pool_sized_stack(deep);
        assert!(nested_too_deep(&result), "{result:?}");
        let calls = format!("{}1{}", "abs(".repeat(20_000), ")".repeat(20_000));
        let result = evaluate_on_a_pool_sized_stack(calls);
        assert!(nested_too_deep(&result), "{result:?}");
        // The model reads it as the tool's error.
        let mut args = serde_json::Map::new();
        args.insert("expression".into(), json!("(".repeat(20_000)));
        let answer = call(Arguments::new(args));
        assert!(
            answer
                .as_ref()
                .is_err_and(|e| e.to_string().contains("nested deeper than")),
            "{answer:?}"
        );
    }

    #[test]
    fn long_chains_of_signs_and_powers_are_an_error_not_a_stack_overflow() {
        for chain in [
            format!("{}1", "-".repeat(20_000)),
            format!("{}1", "+-".repeat(10_000)),
            format!("{}1", "-(".repeat(10_000)),
            format!("{}1", "2^".repeat(20_000)),
            format!("{}1", "1 ** ".repeat(20_000)),
        ] {
            let result = evaluate_on_a_pool_sized_stack(chain.clone());
            assert!(nested_too_deep(&result), "{}: {result:?}", &chain[..8]);
        }
    }

    #[test]
    fn an_expression_nested_exactly_to_the_bound_still_evaluates() {
        let parentheses = format!(
            "{}1 + 2{}",
            "(".repeat(MAX_EXPRESSION_DEPTH),
            ")".repeat(MAX_EXPRESSION_DEPTH)
        );
        assert_eq!(evaluate_on_a_pool_sized_stack(parentheses), Ok(3.0));
        let signs = format!("{}7", "-".repeat(MAX_EXPRESSION_DEPTH));
        assert_eq!(evaluate_on_a_pool_sized_stack(signs), Ok(7.0));
        let powers = format!("{}1", "1 ^ ".repeat(MAX_EXPRESSION_DEPTH));
        assert_eq!(evaluate_on_a_pool_sized_stack(powers), Ok(1.0));
        let one_more = format!("{}7", "-".repeat(MAX_EXPRESSION_DEPTH + 1));
        let result = evaluate_on_a_pool_sized_stack(one_more);
        assert!(nested_too_deep(&result), "{result:?}");
    }

    #[test]
    fn integers_print_without_a_fraction() {
        assert_eq!(
            (
                format_number(391.0),
                format_number(2.5),
                format_number(-4.0)
            ),
            ("391".into(), "2.5".into(), "-4".into())
        );
    }
}
