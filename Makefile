# weft — build, test, demo and benchmark. Run as root on Debian: every target
# installs what it needs first (apt packages once; Go modules from the proxy).

SHELL   := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
GO      ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X github.com/weft-net/weft/router.Version=$(VERSION)
BIN     := $(CURDIR)/bin
export WEFT_BIN_DIR := $(BIN)

# Debian packages the tests, the demo and the benchmarks use.
APT_PKGS := iproute2 nftables iputils-ping iperf3 tcpdump containernetworking-plugins

.PHONY: e2e-kube e2e-kube-short deps-kube
.PHONY: conformance conformance-netpol conformance-tools coredns-tools deps-conformance kube-run
.PHONY: all deps build build-race test test-race-e2e test-long test-unit fuzz demo bench soak chaos clean kube-tools image

all: build

# deps installs the Debian packages that are missing (needs root and apt).
deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@command -v $(GO) >/dev/null || { echo "Go is missing: install Go $$(sed -n 's/^go //p' go.mod) at /usr/local/go"; exit 1; }

build:
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/weft ./cmd/weft
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/weft-cni ./cmd/weft-cni
	$(GO) build -o $(BIN)/portmap github.com/containernetworking/plugins/plugins/meta/portmap
	$(GO) build -o $(BIN)/loopback github.com/containernetworking/plugins/plugins/main/loopback

# build-race: the binaries again, built with the race detector, into
# bin/race, for test-race-e2e.
RACE_BIN := $(BIN)/race
build-race: build
	$(GO) build -race -ldflags '$(LDFLAGS)' -o $(RACE_BIN)/weft ./cmd/weft
	$(GO) build -race -o $(RACE_BIN)/weft-cni ./cmd/weft-cni
	cp $(BIN)/portmap $(RACE_BIN)/portmap
	@$(GO) version -m $(RACE_BIN)/weft | grep -q -- '-race=true' || { echo "$(RACE_BIN)/weft is not race-built"; exit 1; }

# test: everything, with the race detector; root tests run for real in
# network namespaces that the tests make and remove. kube-tools first: the
# Kubernetes tests run a real etcd and kube-apiserver, and the short
# real-node test (e2e-kube-short) a whole cluster (all built once, cached);
# deps-kube installs containerd and runc for it, image builds the images
# its nodes import.
test: deps-kube build build-race kube-tools image
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 20m ./...
	$(GO) test -count=1 -timeout 20m -run '^TestSimulation$$' ./ipalloc -ipalloc.sim.schedules=$(SIM_SCHEDULES)
	$(MAKE) --no-print-directory test-race-e2e
	$(MAKE) --no-print-directory e2e-kube-short
	$(MAKE) --no-print-directory conformance-netpol
	$(MAKE) --no-print-directory fuzz FUZZTIME=50000x

# test-race-e2e: the multi-node and --kube tests again, with race-built
# routers and CNI plugins (bin/race): a data race a daemon reports in its
# log fails the test (e2e.NewTestRun scans every daemon's log).
RACE_E2E ?= ThreeNodes|Dataplane|VXLAN|Reclaim|SplitRings|OnKubernetes|RouterRestart
test-race-e2e: deps build-race kube-tools
	WEFT_BIN_DIR=$(RACE_BIN) $(GO) test -race -count=1 -timeout 20m -run '$(RACE_E2E)' ./e2e/ ./e2e/kubeapi/

# The IPAM simulation's schedules in make test: enough that a bug only 1
# schedule in 300 exposes is caught 99 times in 100 (1-(299/300)^1500).
SIM_SCHEDULES ?= 1500

# test-long: the IPAM simulation over 10,000 schedules (SIM_LONG); a failing
# seed prints its replay command (a readable trace of every step with
# -v -ipalloc.sim.seed=N). SIM_FLAGS adds flags, e.g.
# SIM_FLAGS=-ipalloc.sim.faults=all for the faults still off by default.
SIM_LONG ?= 10000
test-long:
	$(GO) test -count=1 -timeout 3h -run '^TestSimulation$$' ./ipalloc -ipalloc.sim.schedules=$(SIM_LONG) -v $(SIM_FLAGS)

test-unit:
	$(GO) test -race -short ./...

# fuzz: a short run of every fuzz target (FUZZTIME each: a duration, or Nx
# executions; test uses a count because Go 1.26 can fail a duration-bounded
# run with "context deadline exceeded" at its end, golang/go#75804). A
# failure whose input does not reproduce is retried once (hack/fuzz.sh).
FUZZTIME ?= 30s
fuzz:
	@GO=$(GO) FUZZTIME=$(FUZZTIME) hack/fuzz.sh

# demo: a local cluster in network namespaces, pods pinging, status printed.
demo: deps build
	$(BIN)/weft demo

# bench: benchmarks with their baselines, results for docs/benchmarks.md.
bench: deps build
	$(GO) run ./e2e/cmd/cnibench -n 100
	$(GO) run ./e2e/cmd/cnibench -n 200 -c 20
	$(GO) run ./mesh/cmd/meshbench -n 10,50,100 -loss 0,0.1 -runs 5 -idle 30s
	$(GO) run ./e2e/cmd/scalebench -init seed -n 10,100 -idle 20s -timeout 120s
	$(GO) run ./e2e/cmd/scalebench -init seed -n 10,100 -idle 20s -timeout 120s -compress=false
	$(GO) run ./e2e/cmd/scalebench -init consensus -pods -n 200,300 -idle 10s -timeout 240s -timescale 3 -compress=false -meshgate=false
	$(GO) run ./e2e/cmd/scalebench -init consensus -n 10,100 -idle 20s -timeout 120s
	$(GO) run ./e2e/cmd/scalebench -init seed -pods -n 64,100 -idle 20s -timeout 120s
	$(GO) test -run '^$$' -bench Ring ./internal/scale/
	$(GO) test -run '^$$' -bench 'MergeReports|PeerEvent' ./mesh/
	$(GO) run ./tunnel/cmd/tunnelbench
	$(GO) test -run '^$$' -bench 'VXLANPeers|SealedPeers|TableOwner' -benchtime 100x ./tunnel/
	$(GO) run ./e2e/cmd/podbench
	$(GO) run ./e2e/cmd/membench -nodes 3 -idle 60s -sample 15s -warmup-cycles 2000 -cycles 10000
	$(GO) test -run '^$$' -bench . -benchmem ./ipalloc/
	$(GO) test -run '^$$' -bench 'Fdatasync|Commit' -benchtime 4000x ./state/
	$(GO) test -run '^$$' -bench LocalAPIAllocate -benchtime 2000x ./router/
	$(GO) test -run '^$$' -bench LocalAPIAddDel -benchtime 10000x -count 3 ./router/
	$(GO) test -run '^$$' -bench PolicyPropagation -benchtime 30x ./router/
	$(GO) test -run '^$$' -bench PolicySync -benchtime 20x ./bridge/
	$(GO) test -run '^$$' -bench PolicyConnect -benchtime 2000x ./bridge/
	$(GO) test -run '^$$' -bench PolicyThroughput -benchtime 3x ./bridge/
	$(MAKE) --no-print-directory soak

# soak: the idle soak of docs/benchmarks.md: three routers gossiping idle for
# SOAK_IDLE, without and then with a password (both at once would halve the
# wall time), each router's RSS, heap and goroutines read every SOAK_EVERY;
# the samples go to bin/soak.csv.
SOAK_IDLE  ?= 60m
SOAK_EVERY ?= 1m
soak: deps build
	$(GO) run ./e2e/cmd/membench -nodes 3 -idle $(SOAK_IDLE) -sample $(SOAK_EVERY) -series $(BIN)/soak.csv

# chaos: the long chaos runs of docs/reliability.md, TestChaos (--peers,
# rmpeer) and TestChaosKube (--kube, Node deletion): CHAOS_RUNS runs of each,
# CHAOS_OPS steps with a check point every CHAOS_EVERY, at most CHAOS_PODS
# live pods. CHAOS_SEED=0 draws a seed per run (logged); CHAOS_SEED=n
# replays that schedule. The log, with the figures of every run, goes to
# bin/chaos.log.
CHAOS_RUNS  ?= 3
CHAOS_OPS   ?= 200
CHAOS_EVERY ?= 10
CHAOS_PODS  ?= 30
CHAOS_SEED  ?= 0
chaos: deps build kube-tools
	@set -o pipefail; $(GO) test -race -count=$(CHAOS_RUNS) -timeout 180m -v -run '^TestChaos(Kube)?$$' ./e2e/ \
		-chaos.seed=$(CHAOS_SEED) -chaos.ops=$(CHAOS_OPS) -chaos.every=$(CHAOS_EVERY) -chaos.pods=$(CHAOS_PODS) >$(BIN)/chaos.log 2>&1; rc=$$?; \
		grep -E 'chaos summary|VIOLATION|^--- |^(ok|FAIL)' $(BIN)/chaos.log; echo "full log: $(BIN)/chaos.log"; exit $$rc

# kube-tools builds etcd, kube-apiserver, kubectl, kube-controller-manager,
# kube-scheduler, kubelet and kube-proxy (pinned by
# e2e/kubeapi/tools) into the tools cache (WEFT_TOOLS_CACHE, default
# /var/cache/weft-tools) for the control-plane tests: minutes the first time,
# once per go.sum of that module; instant afterwards.
kube-tools:
	nice -n 10 $(GO) run ./e2e/kubeapi/cmd/kube-tools

# image: bin/weft-image.tar, static weft, weft-cni and portmap on an empty
# base, built without a Docker engine; load it with `docker load -i` or
# `ctr -n k8s.io images import` (docs/kubernetes.md).
# The pause image (bin/pause-image.tar, registry.k8s.io/pause:3.10) is the
# pod sandbox for a node without a registry (make e2e-kube imports it).
image:
	$(GO) run ./hack/image -o $(BIN)/weft-image.tar -version $(VERSION)
	$(GO) run ./hack/image -pause -o $(BIN)/pause-image.tar -version $(VERSION)

# e2e-kube: weft on a real cluster on this machine (e2e/kubenodes): etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler and three kubelet
# nodes, each a network and mount namespace with Debian's containerd and
# runc and kube-proxy (nftables); the images imported, then
# `kubectl apply -k e2e/kubenodes/overlay`. Prints each phase's
# duration; on failure the nodes', pods' and events' state and the logs.
# The kubelet's host-wide kernel settings are restored and its cgroups
# removed at the end (docs/kubernetes.md, "Testing on real nodes").
KUBE_APT_PKGS := containerd runc util-linux
deps-kube: deps
	@missing=""; for p in $(KUBE_APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# e2e-kube runs both real-node tests: TestKubeNodes (3 nodes, the
# overlay, what a user meets in order) and E2E_KUBE_SHORT.
e2e-kube: deps-kube build image kube-tools
	$(GO) test -count=1 -v -timeout 40m -run '^(TestKubeNodes|$(E2E_KUBE_SHORT))$$' ./e2e/kubenodes/ -kubenodes

# e2e-kube-short: the real-node test make test runs (about 3 minutes with
# the tools cached): two nodes, deploy/ applied as it is while kube-proxy
# is not running yet (the routers wait for the API server's Service
# address, alive, and go on once it answers), pods across the nodes, then
# the uninstall of docs/kubernetes.md, checked inside each node's
# namespaces. A kernel without a feature the nodes need skips it, saying
# which.
E2E_KUBE_SHORT := TestKubeLateAPIUninstall
e2e-kube-short: deps-kube build image kube-tools
	$(GO) test -count=1 -timeout 20m -run '^$(E2E_KUBE_SHORT)$$' ./e2e/kubenodes/ -kubenodes

# conformance: the Kubernetes e2e suite's network specs against the cluster
# of e2e-kube with weft (e2e/kubenodes TestConformance). e2e.test and
# agnhost are built from e2e/conformance/tools (the pinned k8s.io/kubernetes
# of the cluster's binaries) into the tools cache, once per go.sum (cold:
# tens of minutes; conformance-tools does it alone); agnhost's image is put
# together from that build and this machine's sh, curl, nc, ss and ip, under
# the names e2e.test pulls, and imported into every node (no registry).
# CONFORMANCE_PROCS ginkgo processes run specs at once (1: serially).
# CONFORMANCE_FOCUS / CONFORMANCE_SKIP replace the ginkgo focus and skip of
# docs/kubernetes.md; the log, JSON report and summary go to bin/conformance.
CONFORMANCE_APT_PKGS := curl wget netcat-openbsd iproute2 bash coreutils bind9-dnsutils libc-bin busybox-static
CONFORMANCE_FOCUS ?=
CONFORMANCE_SKIP  ?=
CONFORMANCE_TIMEOUT ?= 80m
CONFORMANCE_PROCS ?= 3
deps-conformance: deps-kube
	@missing=""; for p in $(CONFORMANCE_APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

conformance-tools:
	$(GO) run ./e2e/kubeapi/cmd/kube-tools conformance

# coredns-tools: the cluster DNS of make conformance (CoreDNS pinned by
# e2e/conformance/dns, only the plugins a cluster DNS uses), into the tools
# cache; a few minutes cold.
coredns-tools:
	$(GO) run ./e2e/kubeapi/cmd/kube-tools coredns

conformance: deps-conformance build image kube-tools conformance-tools coredns-tools
	$(GO) test -count=1 -v -timeout 120m -run '^TestConformance$$' ./e2e/kubenodes/ -conformance \
		-conformance.timeout=$(CONFORMANCE_TIMEOUT) -conformance.procs=$(CONFORMANCE_PROCS) \
		$(if $(CONFORMANCE_FOCUS),-conformance.focus='$(CONFORMANCE_FOCUS)') \
		$(if $(CONFORMANCE_SKIP),-conformance.skip='$(CONFORMANCE_SKIP)')

# conformance-netpol: the upstream NetworkPolicy e2e specs
# ([Feature:NetworkPolicy] of the pinned e2e.test, 46 of them; the SCTP
# ones need an sctp module this kernel lacks) on the real-node cluster,
# about 4 minutes once the tools are cached; part of make test. A failing
# spec fails the target; bin/conformance/summary.txt lists each.
NETPOL_FOCUS := \[Feature:NetworkPolicy\]
NETPOL_SKIP := SCTPConnectivity
NETPOL_TIMEOUT ?= 30m
conformance-netpol: deps-conformance build image kube-tools conformance-tools
	$(GO) test -count=1 -timeout 45m -run '^TestConformance$$' ./e2e/kubenodes/ -conformance \
		-conformance.timeout=$(NETPOL_TIMEOUT) -conformance.procs=3 -conformance.dns=false \
		-conformance.focus='$(NETPOL_FOCUS)' -conformance.skip='$(NETPOL_SKIP)'

# kube-run: the cluster of e2e-kube with weft Ready, then CMD (a shell
# command, run in the underlay namespace with KUBECONFIG and KUBECTL set;
# e.g. CMD='sleep 3600' keeps the cluster up for an hour); everything is
# taken down when CMD ends.
KUBE_RUN_TIMEOUT ?= 60m
kube-run: deps-kube build image kube-tools
	@test -n "$(CMD)" || { echo "give the command: make kube-run CMD='...'"; exit 2; }
	$(GO) test -count=1 -v -timeout 120m -run '^TestKubeNodesCommand$$' ./e2e/kubenodes/ \
		-kubenodes.cmd='$(CMD)' -kubenodes.cmd-timeout=$(KUBE_RUN_TIMEOUT)

clean:
	rm -rf $(BIN)
