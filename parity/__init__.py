"""The parity harness: every contract op on seeded inputs (specials included) on every available
backend, compared bit for bit; bundles of output hashes and a short run's ledger for comparing
machines (`open1b parity run | export | compare`)."""
from .backends import BackendUnavailable, available, load, names, register, status, unregister
from .cases import OPS, Case, CaseRNG, case_seed, execute, make_case
from .runner import OpResult, Report, compare_outputs, describe_mismatch, format_table, run, to_numpy
from .bundle import BundleError, Comparison, compare as compare_bundles, export as export_bundle
from .bundle import format_comparison, load as load_bundle

__all__ = ["BackendUnavailable", "available", "load", "names", "register", "status", "unregister", "OPS", "Case",
           "CaseRNG", "case_seed", "execute", "make_case", "OpResult", "Report", "compare_outputs",
           "describe_mismatch", "format_table", "run", "to_numpy", "BundleError", "Comparison", "compare_bundles",
           "export_bundle", "format_comparison", "load_bundle"]
