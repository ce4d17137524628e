//! `async-grpo rollout`, wired: the generator (vLLM or the built-in simulator), tools,
//! rewards and the loop; a writer thread for the JSONL file; progress; Ctrl-C and SIGTERM.

use std::{
    process::ExitCode,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use async_grpo_run::{
    Destination, RunPlan, RunSpec, Running, Servers, SpecError, ToolPool,
    listen::listen_address,
    rows::{Backlog, Pusher, RowStream, ServeRows},
};
use files::{FileError, output::Output};
use rollout::{Agent, DrainReport, Engine, Groups};
use rollout_core::{ChatTokenizer, parse::parser_by_name};
use tool_dispatch::Registry;
use vllm_client::Client;
use vllm_sim::{SimConfig, Simulator};

use super::{
    config::{Resolved, Settings},
    control::ControlEndpoint,
    preflight::{self, Checked},
    progress::{Progress, Totals},
};

/// Exit code of a run stopped by a signal whose drain had to cancel rollouts.
const EXIT_UNCLEAN_DRAIN: u8 = 2;
/// Exit code of a run stopped by a signal before its loop started (the shell's for SIGINT).
const EXIT_INTERRUPTED_AT_START: u8 = 130;

/// Runs the settings to the end (or to a signal) and returns the exit code.
pub(crate) fn run(resolved: Resolved) -> anyhow::Result<ExitCode> {
    let checked = preflight::check(&resolved)?;
    if resolved.settings.servers.is_empty() {
        eprintln!(
            "async-grpo: no --server given: rolling out against the built-in simulator (scripted answers, not a model)"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("rollout")
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(rollout(resolved, checked))
}

async fn rollout(resolved: Resolved, checked: Checked) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let settings = &resolved.settings;
    // Listening from the start: a signal before the loop runs ends the start-up.
    let mut signals = Signals::new()?;
    // Served from now on: `/health` answers while the run waits for its servers.
    let control = start_control(settings)?;
    let Checked {
        tokenizer,
        dataset,
        destination,
        plan: RunPlan {
            plan,
            max_groups,
            total,
        },
        ..
    } = checked;
    if let Some(destination) = &destination {
        say_resumed(destination);
    }
    let rows = start_rows(resolved.rows.clone(), destination.as_ref())?;
    if total == Some(0) {
        // Opened all the same: what was dropped is cut off, and a Parquet output is written.
        let sink = open_output(destination.as_ref())?;
        if let Some(rows) = rows {
            // What the trainer did not acknowledge is served before the run ends.
            let backlog = backlog(&rows, destination.as_ref())?;
            let pusher = rows.pusher();
            tokio::task::spawn_blocking(move || restore(&pusher, backlog.as_ref()))
                .await
                .context("the row stream's backlog was lost")??;
            finish_rows(rows, settings, false).await;
        }
        sink.finish()?;
        eprintln!(
            "async-grpo: every group of this run is already in {}: nothing left to roll out",
            settings.out.display()
        );
        return Ok(ExitCode::SUCCESS);
    }

    let simulator = if settings.servers.is_empty() {
        Some(start_simulator(settings, &tokenizer).await?)
    } else {
        None
    };
    let servers = servers(settings, simulator.as_ref())?;
    let mut spec = run_spec(&resolved, tokenizer, servers)?;
    spec.config_mut().max_groups = max_groups;
    if rows.is_some() {
        // The stream's capacity is the run's buffer: groups waiting in the engine's own would
        // be invisible to the trainer, and older by the time it reads them.
        spec.config_mut().output_buffer = 1;
    }
    let tool_count = spec.tool_count();
    spec.check()?;
    let connected = tokio::select! {
        connected = spec.connect() => connected.map_err(|error| match error {
            SpecError::NotReady { .. } => anyhow::Error::new(error).context(
                "the servers did not become ready (--server-wait sets how long to wait)",
            ),
            error => error.into(),
        })?,
        signal = signals.next() => {
            eprintln!("async-grpo: {signal} while waiting for the servers: nothing was rolled out");
            return Ok(ExitCode::from(EXIT_INTERRUPTED_AT_START));
        }
    };
    // Only now is the output touched: every check that could fail has passed.
    let sink = open_output(destination.as_ref())?;
    let backlog = match &rows {
        Some(rows) => backlog(rows, destination.as_ref())?,
        None => None,
    };
    let items = dataset.items(plan)?;
    let Running {
        engine,
        groups,
        health_checks,
        ..
    } = connected.start(items).await?;
    let totals = Arc::new(Totals::default());
    if let Some(control) = &control {
        control.attach(Arc::clone(&engine), Arc::clone(&totals));
    }
    if let Some(rows) = &rows {
        rows.attach(Arc::clone(&engine));
    }
    tracing::info!(
        config = ?resolved.config_file,
        dataset = %settings.dataset.display(),
        estimator = %settings.estimator,
        out = %settings.out.display(),
        groups = ?total,
        epochs = settings.epochs,
        shard = ?settings.shard.map(|s| s.to_string()),
        num_generations = settings.engine.num_generations,
        max_inflight = settings.engine.max_inflight,
        tools = tool_count,
        max_model_len = ?engine.max_model_len(),
        "rolling out"
    );

    let pusher = rows.as_ref().map(RowStream::pusher);
    let (writer, done_rx) = start_writer(groups, sink, pusher, backlog, Arc::clone(&totals))?;
    let progress = Progress::start(
        settings.progress,
        total,
        Arc::clone(&totals),
        Arc::clone(&engine),
    );

    let (interrupted, report) = wait_and_drain(
        &engine,
        &mut signals,
        done_rx,
        &progress,
        rows.as_ref(),
        settings.drain_timeout,
    )
    .await;
    let written = tokio::task::spawn_blocking(move || writer.join())
        .await
        .context("the writer thread was lost")?
        .map_err(|_| anyhow::anyhow!("the writer thread panicked"))?;
    if let Some(rows) = rows {
        finish_rows(rows, settings, interrupted).await;
    }
    progress.finish(&engine.health(), total).await;
    drop(health_checks);
    drop(control);
    if let Some(simulator) = simulator {
        simulator.stop().await;
    }
    summary(settings, &report, &totals, started.elapsed());
    rewards_summary(&engine.scorer().stats());
    let written = written.with_context(|| format!("cannot write {}", settings.out.display()))?;
    exit_code(settings, &report, interrupted, written)
}

/// The control endpoint, when `--listen` asks for one.
fn start_control(settings: &Settings) -> anyhow::Result<Option<ControlEndpoint>> {
    let Some(address) = &settings.listen else {
        return Ok(None);
    };
    let address = listen_address(address, super::control::SET_TOKEN)
        .map_err(|e| anyhow::anyhow!("--listen: {e}"))?;
    let control = ControlEndpoint::start(address, settings.listen_token.clone())?;
    tracing::info!(address = %control.address(), "control endpoint listening");
    Ok(Some(control))
}

/// The row stream, when `--serve-rows` asks for one; a resumed output's groups keep their
/// positions, and this run's come after them.
fn start_rows(
    serve: Option<ServeRows>,
    destination: Option<&Destination>,
) -> anyhow::Result<Option<RowStream>> {
    let Some(serve) = serve else {
        return Ok(None);
    };
    let tls = serve.tls();
    let first = destination.map_or(0, |d| d.resumed().done.len() as u64);
    let rows = RowStream::start(serve, first)?;
    eprintln!(
        "async-grpo: serving rows on {}{}",
        rows.address(),
        if tls { " (TLS)" } else { "" }
    );
    Ok(Some(rows))
}

/// Once the output is open: acknowledgements recorded beside it, and what a resumed output
/// holds that no trainer acknowledged, to serve again.
fn backlog(rows: &RowStream, destination: Option<&Destination>) -> anyhow::Result<Option<Backlog>> {
    let Some(destination) = destination else {
        return Ok(None);
    };
    Ok(Some(
        rows.record_to(destination.path(), destination.resumes())?,
    ))
}

/// Serves a resumed output's unacknowledged groups again (the writer thread, first).
fn restore(pusher: &Pusher, backlog: Option<&Backlog>) -> anyhow::Result<()> {
    let Some(backlog) = backlog else {
        return Ok(());
    };
    let restored = pusher.restore(backlog)?;
    if restored > 0 {
        eprintln!(
            "async-grpo: serving again {restored} groups of the output no trainer acknowledged"
        );
    }
    Ok(())
}

/// Ends the row stream: after a signal at once, else once every group is acknowledged or
/// `--drain-timeout` passed.
async fn finish_rows(rows: RowStream, settings: &Settings, interrupted: bool) {
    // After a signal, no wait for a trainer: what it did not acknowledge is in the file.
    let wait = if interrupted {
        Duration::ZERO
    } else {
        settings.drain_timeout
    };
    let left = rows.finish(wait).await;
    if left > 0 {
        eprintln!(
            "async-grpo: the row stream ended with {left} groups not acknowledged within \
             --drain-timeout (they are in {}, served again by a --resume)",
            settings.out.display()
        );
    }
}

/// The writer thread (files block): every scored group to the output, one write each; the
/// receiver hears when the output has ended.
type Writer = std::thread::JoinHandle<anyhow::Result<(u64, u64)>>;

fn start_writer(
    groups: Groups,
    sink: Output,
    rows: Option<Pusher>,
    backlog: Option<Backlog>,
    totals: Arc<Totals>,
) -> anyhow::Result<(Writer, tokio::sync::oneshot::Receiver<()>)> {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let writer = std::thread::Builder::new()
        .name("rollout-writer".to_owned())
        .spawn(move || {
            let result = rows
                .as_ref()
                .map_or(Ok(()), |rows| restore(rows, backlog.as_ref()))
                .and_then(|()| write_groups(groups, sink, rows.as_ref(), &totals));
            let _ = done_tx.send(());
            result
        })
        .context("cannot start the writer thread")?;
    Ok((writer, done_rx))
}

/// What the run's exit says: the rows written, and success unless it stopped early, a drain
/// after a signal had to cancel rollouts, or nothing was written.
fn exit_code(
    settings: &Settings,
    report: &DrainReport,
    interrupted: bool,
    (groups_written, samples_written): (u64, u64),
) -> anyhow::Result<ExitCode> {
    eprintln!(
        "async-grpo: wrote {samples_written} training rows of {groups_written} groups to {}",
        settings.out.display()
    );
    if let Some(error) = &report.error {
        bail!("the run stopped early: {error}");
    }
    if interrupted && !report.clean {
        return Ok(ExitCode::from(EXIT_UNCLEAN_DRAIN));
    }
    if samples_written == 0 {
        bail!(
            "no training row was written: {}",
            if interrupted {
                "the run was stopped before any group was complete"
            } else {
                "no group was complete and kept (see the failures above)"
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Waits until the dataset is done (the writer sees the output end) or a signal comes, then
/// drains the engine; a second signal cancels the rollouts in flight. Returns whether a
/// signal stopped the run, and the drain's report.
async fn wait_and_drain(
    engine: &Engine<Client>,
    signals: &mut Signals,
    done: tokio::sync::oneshot::Receiver<()>,
    progress: &Progress,
    rows: Option<&RowStream>,
    drain_timeout: Duration,
) -> (bool, DrainReport) {
    let interrupted = tokio::select! {
        _ = done => false,
        signal = signals.next() => {
            progress.pause();
            if let Some(rows) = rows {
                // A writer waiting for the trainer must not hold the drain: what it does not
                // push is in the output file.
                rows.close();
            }
            eprintln!(
                "async-grpo: {signal}: draining (up to {}; {signal} again cancels at once)",
                humantime::format_duration(drain_timeout)
            );
            true
        }
    };
    let mut cancelled = false;
    let drain = engine.shutdown(drain_timeout);
    tokio::pin!(drain);
    let report = loop {
        tokio::select! {
            report = &mut drain => break report,
            signal = signals.next(), if !cancelled => {
                eprintln!("async-grpo: {signal} again: cancelling the rollouts in flight");
                engine.cancel();
                cancelled = true;
            }
        }
    };
    (interrupted, report)
}

/// The servers of the run: `--server`s, or the built-in simulator.
fn servers(settings: &Settings, simulator: Option<&Simulator>) -> anyhow::Result<Servers> {
    let urls = match simulator {
        Some(simulator) => vec![simulator.url()],
        None => settings.servers.clone(),
    };
    let root_certificates_pem = match &settings.ca_cert {
        Some(pem) => {
            Some(std::fs::read(pem).with_context(|| format!("cannot read {}", pem.display()))?)
        }
        None => None,
    };
    Ok(Servers {
        urls,
        model: settings.model.clone(),
        root_certificates_pem,
    })
}

/// The run's engine: its settings, tools, rewards, environment or agent, parser and tool
/// pool, on `servers`.
fn run_spec(
    resolved: &Resolved,
    tokenizer: ChatTokenizer,
    servers: Servers,
) -> anyhow::Result<RunSpec> {
    let settings = &resolved.settings;
    let mut registry = Registry::new();
    let sandbox = resolved.sandbox();
    for tool in &settings.tools {
        registry.add(tool.build_for(&sandbox, settings.engine.max_inflight)?)?;
    }
    let mut spec = RunSpec::new(settings.engine.clone(), tokenizer, servers)
        .tools(registry)
        .tool_pool(ToolPool {
            threads: settings.tool_threads,
            ..ToolPool::default()
        })
        .rewards(resolved.reward_functions());
    if let Some(environment) = settings.environment.clone() {
        let sandbox = sandbox.clone();
        spec = spec.environment(Box::new(move |tools| {
            Arc::new(environment.harness(tools, sandbox))
        }));
    }
    if let Some(agent) = settings.agent.clone() {
        spec = spec.agent(Box::new(move |proxy| match agent.agent(proxy, sandbox) {
            Ok(agent) => Ok(Arc::new(agent) as Arc<dyn Agent>),
            Err(error) => Err(error.to_string()),
        }));
    }
    if let Some(name) = &settings.tool_parser {
        spec = spec.parser(parser_by_name(name)?);
    }
    Ok(spec)
}

/// The built-in simulator, answering in the run's tokenizer and calling its first tool.
async fn start_simulator(
    settings: &Settings,
    tokenizer: &ChatTokenizer,
) -> anyhow::Result<Simulator> {
    let mut config = SimConfig::with_settings(tokenizer.tokenizer().clone(), &settings.simulator);
    // What the `[simulator]` table leaves open, the run decides: its first tool, its
    // tokenizer's end-of-answer token.
    if settings.simulator.tool_name.is_none()
        && let Some(tool) = settings.tools.first()
    {
        config.tool_name = tool.name.clone();
    }
    if settings.simulator.eos_token.is_none()
        && let Some(eos) = tokenizer
            .special_tokens()
            .get("eos_token")
            .and_then(serde_json::Value::as_str)
    {
        config.eos_token = eos.to_owned();
    }
    let simulator = Simulator::start(config, ([127, 0, 0, 1], 0).into())
        .await
        .context("cannot start the built-in simulator")?;
    tracing::info!(url = %simulator.url(), "simulator listening");
    Ok(simulator)
}

/// The output: stdout, or `--out` created, emptied or (`--resume`) continued.
fn open_output(destination: Option<&Destination>) -> Result<Output, FileError> {
    match destination {
        Some(destination) => destination.open(),
        None => Ok(Output::stdout()),
    }
}

/// Says what a resumed output already held and what was dropped of it.
fn say_resumed(destination: &Destination) {
    if !destination.resumes() {
        return;
    }
    let resumed = destination.resumed();
    eprintln!(
        "async-grpo: resuming {}: {} groups ({} rows) already written are kept",
        destination.path().display(),
        resumed.done.len(),
        resumed.samples
    );
    for dropped in &resumed.dropped {
        eprintln!("async-grpo: resuming: dropped {dropped}");
    }
}

/// The writer thread: each group in one write and a flush, so a killed run leaves complete
/// lines only; then the output closed (a Parquet one written). Returns the groups and
/// samples written.
fn write_groups(
    mut groups: Groups,
    mut sink: Output,
    rows: Option<&Pusher>,
    totals: &Totals,
) -> anyhow::Result<(u64, u64)> {
    while let Some(group) = groups.blocking_recv() {
        sink.write_group(&group.samples)?;
        // Written first: a group the stream holds is in the file, for a resume.
        if let Some(rows) = rows {
            // Not pushed once the stream is closed (a signal): the group is in the file.
            rows.push(&group.samples)?;
        }
        totals.groups.fetch_add(1, Ordering::Relaxed);
        totals
            .samples
            .fetch_add(group.samples.len() as u64, Ordering::Relaxed);
        totals.tokens.fetch_add(
            group
                .samples
                .iter()
                .map(|s| s.input_ids.len() as u64)
                .sum::<u64>(),
            Ordering::Relaxed,
        );
        if let Some(reward) = group.metrics.get("reward") {
            totals.add_reward(*reward);
        }
    }
    Ok(sink.finish()?)
}

/// Ctrl-C and SIGTERM, as one stream, listened for from the start of the run.
struct Signals {
    received: tokio::sync::mpsc::UnboundedReceiver<&'static str>,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        let (sender, received) = tokio::sync::mpsc::unbounded_channel();
        #[cfg(unix)]
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .context("cannot listen for SIGTERM")?;
        tokio::spawn(async move {
            loop {
                #[cfg(unix)]
                let name = tokio::select! {
                    result = tokio::signal::ctrl_c() => result.map(|()| "Ctrl-C"),
                    _ = terminate.recv() => Ok("SIGTERM"),
                };
                #[cfg(not(unix))]
                let name = tokio::signal::ctrl_c().await.map(|()| "Ctrl-C");
                let Ok(name) = name else {
                    tracing::warn!("cannot listen for Ctrl-C: signals will end the process");
                    return;
                };
                if sender.send(name).is_err() {
                    return;
                }
            }
        });
        Ok(Signals { received })
    }

    /// The next signal's name (never, once the listener is gone).
    async fn next(&mut self) -> &'static str {
        match self.received.recv().await {
            Some(name) => name,
            None => std::future::pending().await,
        }
    }
}

/// The reward functions that failed on a group, on stderr: how often, by cause, and the last
/// failure's words.
fn rewards_summary(rewards: &[(String, scoring::RewardStats)]) {
    let words = |message: &str| -> String { message.chars().take(300).collect() };
    for (name, stats) in rewards {
        let failed = stats.errors + stats.panics + stats.timeouts + stats.wrong_length;
        if failed > 0 {
            let last = stats.last_failure.as_ref().map_or_else(String::new, |f| {
                format!("; the last: {}", words(&f.message))
            });
            eprintln!(
                "async-grpo: reward '{name}' failed on {failed} of {} groups ({} errors, {} \
                 timeouts, {} panics, {} with the wrong number of scores), its column empty for \
                 those{last}",
                stats.groups, stats.errors, stats.timeouts, stats.panics, stats.wrong_length,
            );
        }
        if stats.non_finite > 0 {
            eprintln!(
                "async-grpo: reward '{name}' gave {} scores that were NaN, infinite or beyond \
                 ±{:e}, each left unscored",
                stats.non_finite,
                scoring::MAX_REWARD
            );
        }
        if let Some(calls) = &stats.calls {
            let last = calls
                .last_failure
                .as_deref()
                .map_or_else(String::new, |message| {
                    format!("; the last: {}", words(message))
                });
            eprintln!(
                "async-grpo: reward '{name}' made {} calls ({} retried attempts, {} answers from \
                 its cache); {} failed ({} transport, {} status, {} unreadable), what they \
                 scored unscorable{last}",
                calls.calls,
                calls.retries,
                calls.cache_hits,
                calls.failed(),
                calls.transport,
                calls.status,
                calls.unreadable,
            );
        }
    }
}

/// The final summary, on stderr.
fn summary(settings: &Settings, report: &DrainReport, totals: &Totals, elapsed: Duration) {
    let stats = &report.stats;
    eprintln!(
        "async-grpo: {} groups scored in {:.1}s ({} dropped: {} too few successes, {} zero variance, {} non-finite advantages, {} cancelled by a drain or a pause, {} stale); mean reward {}",
        stats.groups_completed,
        elapsed.as_secs_f64(),
        stats.groups_too_small
            + stats.groups_zero_variance
            + stats.groups_non_finite
            + stats.groups_cancelled
            + stats.groups_stale,
        stats.groups_too_small,
        stats.groups_zero_variance,
        stats.groups_non_finite,
        stats.groups_cancelled,
        stats.groups_stale,
        totals
            .mean_reward()
            .map_or_else(|| "-".to_owned(), |r| format!("{r:.3}")),
    );
    eprintln!(
        "async-grpo: {} rollouts completed, {} failed, {} retried, {} cancelled; {} turns, {} tokens sampled, {} tool calls ({} errors)",
        stats.rollouts_completed,
        stats.rollouts_failed,
        stats.rollouts_retried,
        stats.rollouts_cancelled,
        stats.turns,
        stats.sampled_tokens,
        stats.tool_calls,
        stats.tool_errors,
    );
    for failure in report.failures.iter().take(5) {
        eprintln!("async-grpo:   {failure}");
    }
    if report.failures.len() > 5 {
        eprintln!(
            "async-grpo:   ... and {} more failures (see the log)",
            stats.rollouts_failed.saturating_sub(5)
        );
    }
    if stats.answers_continued + stats.rows_offpolicy_dropped + stats.tokens_offpolicy_masked > 0
        || stats.routing_missing_tokens > 0
    {
        eprintln!(
            "async-grpo: off-policy: {} answers continued across a pause, {} rows dropped and {} tokens masked past max_token_staleness, {} tokens without routed experts",
            stats.answers_continued,
            stats.rows_offpolicy_dropped,
            stats.tokens_offpolicy_masked,
            stats.routing_missing_tokens,
        );
    }
    if stats.bad_rows > 0 {
        eprintln!("async-grpo: {} bad dataset row(s) skipped:", stats.bad_rows);
        for row in report.bad_rows.iter().take(5) {
            eprintln!("async-grpo:   {row}");
        }
    }
    let tools = report.tools.as_ref().map_or_else(String::new, |t| {
        format!(
            "; tool calls at shutdown: {} finished, {} cancelled before they ran, {} cut at the \
             deadline; {} tool threads joined, {} left running",
            t.completed, t.cancelled, t.still_running, t.threads_joined, t.threads_detached
        )
    });
    // Rollouts cancelled by the drain either were running when it gave up on them (then the
    // drain is not clean) or had been admitted but not yet started (a clean drain may have
    // those: admission simply stopped).
    let not_started = stats
        .rollouts_cancelled
        .saturating_sub(report.cancelled_at_deadline);
    let drain = if report.clean {
        "clean: every rollout in flight finished".to_owned()
    } else {
        format!(
            "NOT clean: {} rollouts in flight cancelled",
            report.cancelled_at_deadline
        )
    };
    eprintln!(
        "async-grpo: drain {drain} in {:.0} ms ({not_started} admitted but not started{tools}); output {}",
        report.elapsed.as_secs_f64() * 1e3,
        settings.out.display(),
    );
}
