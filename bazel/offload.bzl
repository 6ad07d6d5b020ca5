"""The project's C++ rules: every target gets COPTS, every test a size.

Use these instead of cc_library/cc_binary/cc_test so that warnings-as-errors
and test sizes are set in one place. `copts` adds to COPTS (for example an
ISA kernel's -m flags); `size` overrides the default "small".
"""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library", "cc_test")
load("//bazel:copts.bzl", "COPTS")

def offload_cc_library(name, copts = [], **kwargs):
    cc_library(name = name, copts = COPTS + copts, **kwargs)

def offload_cc_binary(name, copts = [], **kwargs):
    cc_binary(name = name, copts = COPTS + copts, **kwargs)

def offload_cc_test(name, copts = [], size = "small", **kwargs):
    cc_test(name = name, size = size, copts = COPTS + copts, **kwargs)
