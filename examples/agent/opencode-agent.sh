#!/bin/sh
# Runs opencode (https://opencode.ai) on the task ($1) in the current directory, the
# rollout's fresh working directory, against the model behind OPENAI_BASE_URL with the
# rollout's OPENAI_API_KEY (the engine's recording proxy sets both per rollout).
#
# opencode is the pinned npm package `cargo xtask agent` installs into the cache
# ($OPENCODE overrides where it is). Everything it writes (its config, state and caches)
# stays in .agent-home/ in the rollout's directory, removed with it; nothing reaches the
# network but the proxy.
set -eu
cache="${ASYNC_GRPO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/async-grpo}"
opencode="${OPENCODE:-$cache/opencode/node_modules/.bin/opencode}"
home="$PWD/.agent-home"
mkdir -p "$home"
cat > "$home/opencode.json" <<JSON
{
  "\$schema": "https://opencode.ai/config.json",
  "autoupdate": false,
  "share": "disabled",
  "snapshot": false,
  "model": "policy/policy",
  "small_model": "policy/policy",
  "provider": {
    "policy": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "Policy",
      "options": { "baseURL": "$OPENAI_BASE_URL", "apiKey": "$OPENAI_API_KEY" },
      "models": {
        "policy": { "name": "Policy", "tool_call": true, "limit": { "context": 65536, "output": 1024 } }
      }
    }
  }
}
JSON
export HOME="$home" XDG_DATA_HOME="$home/data" XDG_STATE_HOME="$home/state" XDG_CACHE_HOME="$home/cache"
# Its plugin package, installed once next to opencode (else opencode fetches it at start).
# opencode writes into its config folder, and the sandbox keeps the cache read-only: the
# folder is made in the rollout's directory, the installed package linked in.
config="$home/config/opencode"
mkdir -p "$config"
cp "$cache/opencode-config/opencode/package.json" "$cache/opencode-config/opencode/package-lock.json" "$config/"
ln -s "$cache/opencode-config/opencode/node_modules" "$config/node_modules"
export XDG_CONFIG_HOME="$home/config"
export OPENCODE_CONFIG="$home/opencode.json"
export OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_SHARE=1 \
    OPENCODE_DISABLE_DEFAULT_PLUGINS=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1 \
    OPENCODE_DISABLE_EXTERNAL_SKILLS=1 OPENCODE_DISABLE_CLAUDE_CODE=1
# The task on stdin (as an argument opencode would quote it). opencode also asks the model
# for a title for its session: a side conversation, which `[agent] conversations = "main"`
# (the default) keeps out of the rows.
printf '%s' "$1" | "$opencode" run --model policy/policy --format json
