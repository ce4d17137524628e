//! Settings structs as flags laid over a value: each struct derives `clap::Args` and serde
//! from one declaration, and [`Layer`] parses its flags *without defaults*, so that a flag
//! not given leaves the value below it (a file's, or the `Default`) as it is. The help still
//! shows each default, taken from the struct's `Default` impl.

use std::marker::PhantomData;

use clap::{Arg, ArgAction, ArgMatches, Args, FromArgMatches, parser::ValueSource};

/// A settings struct whose defaults, as its file would hold them, the help shows.
pub(crate) trait Defaults {
    /// The defaults as TOML keys and values.
    fn defaults_table() -> toml::Table;
}

/// The flags of `T` as given on the command line, to be laid over a value of `T`.
#[derive(Debug, Clone)]
pub(crate) struct Layer<T> {
    matches: ArgMatches,
    of: PhantomData<fn() -> T>,
}

impl<T: Args> FromArgMatches for Layer<T> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(Layer {
            matches: matches.clone(),
            of: PhantomData,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.matches = matches.clone();
        Ok(())
    }
}

impl<T: Args + Defaults> Args for Layer<T> {
    fn augment_args(command: clap::Command) -> clap::Command {
        let defaults = T::defaults_table();
        // Only `T`'s own flags: the command may hold others, parsed as usual.
        let others: Vec<clap::Id> = command
            .get_arguments()
            .map(|arg| arg.get_id().clone())
            .collect();
        T::augment_args_for_update(command).mut_args(|arg| {
            if others.contains(arg.get_id()) {
                arg
            } else {
                for_layering(arg, &defaults)
            }
        })
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

impl<T: Args> Layer<T> {
    /// Sets the fields of `value` whose flags were given.
    pub(crate) fn lay_over(&self, value: &mut T) -> anyhow::Result<()> {
        value
            .update_from_arg_matches(&self.matches)
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// Whether the flag of the field `id` was given.
    pub(crate) fn given(&self, id: &str) -> bool {
        // `ids` first: asking clap about an id it does not know panics in debug builds.
        self.matches.ids().any(|known| known.as_str() == id)
            && self.matches.value_source(id) == Some(ValueSource::CommandLine)
    }
}

/// A setting's flag made fit to be laid over a value: a switch has no implicit `false`
/// (which would undo a `true` below it), and the help shows the default.
fn for_layering(arg: Arg, defaults: &toml::Table) -> Arg {
    let arg = if matches!(arg.get_action(), ArgAction::SetTrue) {
        arg.action(ArgAction::Set)
            .num_args(0)
            .default_missing_value("true")
    } else {
        arg
    };
    let key = arg
        .get_long()
        .map(|long| long.replace('-', "_"))
        .filter(|long| defaults.contains_key(long))
        .unwrap_or_else(|| arg.get_id().as_str().to_owned());
    let shown = match defaults.get(&key) {
        Some(toml::Value::String(text)) if !text.is_empty() => text.clone(),
        Some(toml::Value::Boolean(_) | toml::Value::Array(_) | toml::Value::String(_)) | None => {
            return arg;
        }
        Some(value) => value.to_string(),
    };
    let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
    arg.help(format!("{help} [default: {shown}]"))
}
