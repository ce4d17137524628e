//! Integration tests of the scoring crate: one test binary, one module per area.

#[cfg(all(feature = "command", feature = "scorer"))]
mod command;
mod estimators;
mod properties;
#[cfg(feature = "scorer")]
mod scorer;
#[cfg(feature = "table")]
mod table;

/// Asserts that two float slices are equal within `tolerance`, element by element.
#[track_caller]
pub(crate) fn assert_close(actual: &[f64], expected: &[f64], tolerance: f64) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "lengths differ: {actual:?} vs {expected:?}"
    );
    for (index, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= tolerance,
            "element {index}: {a} is not within {tolerance} of {e}\n{actual:?}\n{expected:?}"
        );
    }
}
