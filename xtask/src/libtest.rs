//! What a `cargo test` run printed: the tests that passed, by name and by libtest's summary
//! count, so that a step fails when the tests it exists for did not run (a renamed test or
//! module matches no filter, and libtest passes with "0 passed").

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::describe;

/// The tests a run passed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Passed {
    /// Each `test <name> ... ok` line's name.
    pub(crate) names: Vec<String>,
    /// The sum of the `test result: ok. N passed; ...` lines' N (one line per test binary).
    pub(crate) count: usize,
}

impl Passed {
    /// Reads libtest's output (its default, one line per test, format).
    pub(crate) fn parse(output: &str) -> Passed {
        let mut passed = Passed::default();
        for line in output.lines() {
            if let Some(summary) = line.strip_prefix("test result: ") {
                passed.count += summary
                    .split(';')
                    .find_map(|part| {
                        let (_, rest) = part.split_once(". ").unwrap_or(("", part));
                        rest.trim().strip_suffix(" passed")?.parse::<usize>().ok()
                    })
                    .unwrap_or(0);
            } else if let Some(name) = line
                .strip_prefix("test ")
                .and_then(|rest| rest.strip_suffix(" ... ok"))
            {
                passed.names.push(name.to_owned());
            }
        }
        passed
    }

    /// Fails unless every test of `expected` passed and at least as many as `expected` holds
    /// were counted; `what` and `hint` say which step and what to check.
    pub(crate) fn expect(&self, what: &str, expected: &[&str], hint: &str) -> anyhow::Result<()> {
        let missing: Vec<&str> = expected
            .iter()
            .copied()
            .filter(|name| !self.names.iter().any(|passed| passed == name))
            .collect();
        let mut problems = Vec::new();
        if self.count < expected.len().max(1) {
            problems.push(format!(
                "ran {} tests where it expects at least {}",
                self.count,
                expected.len().max(1)
            ));
        }
        if !missing.is_empty() {
            problems.push(format!("did not pass {}", missing.join(", ")));
        }
        if !problems.is_empty() {
            bail!("{what} {}: {hint}", problems.join(" and "));
        }
        Ok(())
    }
}

/// Runs `command` (a `cargo test`) with its output shown as it comes (stdout is also kept);
/// fails, naming it, unless it succeeds; returns the tests it passed.
pub(crate) fn run(command: &mut Command) -> anyhow::Result<Passed> {
    let mut child = command
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start {}", describe(command)))?;
    let stdout = child
        .stdout
        .take()
        .context("the test run's stdout is piped")?;
    let mut kept = String::new();
    let mut shown = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading the test run's output")?;
        // Passed through as the test run wrote it.
        writeln!(shown, "{line}")?;
        kept.push_str(&line);
        kept.push('\n');
    }
    drop(shown);
    let status = child.wait().context("waiting for the test run")?;
    if !status.success() {
        bail!("{} failed ({status})", describe(command));
    }
    Ok(Passed::parse(&kept))
}

#[cfg(test)]
mod tests {
    use super::Passed;

    const ONE: &str = "\nrunning 1 test\nthe report\ntest parity::every ... ok\n\n\
                       test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; \
                       60 filtered out; finished in 13.28s\n\n";

    #[test]
    fn passed_tests_are_read_by_name_and_by_the_summary_count() {
        assert_eq!(
            Passed::parse(ONE),
            Passed {
                names: vec!["parity::every".to_owned()],
                count: 1
            }
        );
    }

    #[test]
    fn the_expected_test_passing_is_enough() {
        assert!(
            Passed::parse(ONE)
                .expect("parity", &["parity::every"], "renamed?")
                .is_ok()
        );
    }

    #[test]
    fn a_filter_that_matches_nothing_is_an_error() {
        let output = "\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; \
                      0 measured; 61 filtered out; finished in 0.00s\n";
        let error = Passed::parse(output)
            .expect("parity", &["parity::every"], "renamed?")
            .expect_err("nothing ran");
        assert_eq!(
            error.to_string(),
            "parity ran 0 tests where it expects at least 1 and did not pass \
             parity::every: renamed?"
        );
    }

    #[test]
    fn an_expected_test_missing_among_others_is_an_error() {
        let output = "test a ... ok\ntest b ... ok\ntest result: ok. 2 passed; 0 failed\n";
        let passed = Passed::parse(output);
        assert_eq!(passed.count, 2);
        let error = passed
            .expect("loom", &["a", "c"], "renamed?")
            .expect_err("c did not run");
        assert_eq!(error.to_string(), "loom did not pass c: renamed?");
        assert!(passed.expect("loom", &["a", "b"], "renamed?").is_ok());
    }

    #[test]
    fn the_summaries_of_several_test_binaries_add_up() {
        let output = "test result: ok. 2 passed; 0 failed\ntest result: ok. 3 passed; 0 failed\n";
        assert_eq!(Passed::parse(output).count, 5);
    }
}
