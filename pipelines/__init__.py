"""Beam jobs that turn raw text into sharded Arrow sentence-pair records."""
