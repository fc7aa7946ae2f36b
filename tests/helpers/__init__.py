"""What several test modules share: tiny configs, the CLI runner, a world of one."""
