//! MCP servers as environments (see the e2e test of the binary for real servers).
