"""A server plugin that fails to import (the tests' broken KVPS_SERVER_PLUGINS module)."""

raise RuntimeError('kvps_broken_plugin is broken on purpose')
