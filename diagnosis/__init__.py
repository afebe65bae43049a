"""Rule-based diagnosis: sources fill typed facts, rules turn them into findings with evidence and fixes."""
