// Package conformance builds what `make conformance` runs against the
// real-node cluster of e2e/kubenodes: the Kubernetes e2e suite (e2e.test,
// the test binary of k8s.io/kubernetes/test/e2e) and agnhost, both from the
// pinned module ./tools at the cluster's own Kubernetes version, built once
// per go.sum into the tools cache beside e2e/kubeapi's binaries; and
// agnhost's image, put together locally (no registry) under the exact
// names e2e.test pulls, for importing into each node's containerd. Results
// reads the suite's JUnit report into pass, fail and skip counts.
package conformance
