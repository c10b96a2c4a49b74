"""The audit (DESIGN §8, paper §5): replay a run's steps, certify them, and merge the certificates.

An auditor replays a range of steps on any backend and machine from the checkpoint at or before
its start and compares every recomputed ledger record with the run's; equal records are certified
in a sealed (optionally signed) attestation. No single auditor replays a whole run: a plan splits
it into checkpoint-aligned ranges, one per auditor, and a coverage report merges the attestations
and says whether the run hash is fully certified. One job per module:

    run           the run under audit: its verified ledger and checkpoint metadata (RunView)
    replay        replay and compare steps (audit), certify a range (certify), recompute the
                  run hash from the artifacts (run_hash: `open1b hash`)
    attestation   the attestation document: seal, Ed25519 keys and signatures, environment
    plan          split a run into auditors' ranges; read and check plans
    coverage      verify attestations against the run and merge them (report, format_report)
"""
from .attestation import (ATT_KIND, check_signature, digest, environment, generate_key, hardware_label,
                          load_private_key, make_attestation, parse_public_key, public_key_hex, seal, seal_of, sign)
from .coverage import format_report, report, verify_attestation
from .plan import PLAN_KIND, check_plans, load_plan, make_plan, planned_range, write_plan
from .replay import COMPARED, COMPARED_GNMR, audit, certify, check_against_ledger, run_hash
from .run import AttestError, RunView, checkpoint_meta, load_run

__all__ = ["ATT_KIND", "COMPARED", "COMPARED_GNMR", "PLAN_KIND", "AttestError", "RunView", "audit", "certify",
           "check_against_ledger", "check_plans", "check_signature", "checkpoint_meta", "digest", "environment",
           "format_report", "generate_key", "hardware_label", "load_plan", "load_private_key", "load_run",
           "make_attestation", "make_plan", "parse_public_key", "planned_range", "public_key_hex", "report",
           "run_hash", "seal", "seal_of", "sign", "verify_attestation", "write_plan"]
