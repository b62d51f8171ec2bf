package conformance

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"

	"github.com/weft-net/weft/e2e/kubeapi"
)

// recipe changes whenever the way the tools are built changes, so that a new
// recipe never reuses an old cache entry.
const recipe = "conformance-build-2"

// Tools are the cached e2e suite and agnhost.
type Tools struct {
	Dir     string // the cache entry
	E2ETest string // e2e.test: go test -c k8s.io/kubernetes/test/e2e
	Agnhost string // agnhost: k8s.io/kubernetes/test/images/agnhost, static
	Ginkgo  string // the ginkgo CLI of the suite's ginkgo, for parallel runs
	// KubeSrc is the k8s.io/kubernetes module's source directory (agnhost's
	// porter certificates come from there).
	KubeSrc string
}

func toolsIn(dir, src string) Tools {
	return Tools{Dir: dir, E2ETest: filepath.Join(dir, "e2e.test"), Agnhost: filepath.Join(dir, "agnhost"), Ginkgo: filepath.Join(dir, "ginkgo"), KubeSrc: src}
}

// tools are the binaries of the cache entry, in build order; the kube ones
// carry the pinned version as e2e/kubeapi's do (e2e.test logs it and
// compares it with the server's).
var tools = []kubeapi.Tool{
	{Name: "agnhost", Note: "a minute or two", Pkg: "k8s.io/kubernetes/test/images/agnhost"},
	{Name: "ginkgo", Note: "seconds", Args: func(out string) []string {
		return []string{"build", "-trimpath", "-ldflags", "-s -w", "-o", out, "github.com/onsi/ginkgo/v2/ginkgo"}
	}},
	{Name: "e2e.test", Note: "first time, 15 to 40 minutes on two busy cores", Args: func(out string) []string {
		return []string{"test", "-c", "-vet=off", "-trimpath", "-ldflags", kubeapi.Ldflags(), "-o", out, "k8s.io/kubernetes/test/e2e"}
	}},
}

// toolsSubdir is the tools module in the weft repository.
var toolsSubdir = filepath.Join("e2e", "conformance", "tools")

// Build returns e2e.test and agnhost from the tools cache (e2e/kubeapi's),
// building them first when it has no entry for the tools module and Go
// version (the e2e suite takes many minutes cold). Concurrent callers wait
// for one build.
func Build(ctx context.Context, log *slog.Logger) (Tools, error) {
	root, err := kubeapi.RepoRoot()
	if err != nil {
		return Tools{}, err
	}
	toolsDir := filepath.Join(root, toolsSubdir)
	src, err := kubeapi.Go(ctx, toolsDir, "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes")
	if err != nil {
		return Tools{}, err
	}
	entry, err := kubeapi.CachedTools{
		Module:   toolsDir,
		KeyFiles: []string{"go.mod", "go.sum", "tools.go"},
		Recipe:   recipe,
		Prefix:   "conformance",
		What:     "the e2e suite and agnhost",
		Tools:    tools,
		Nice:     true,
	}.Ensure(ctx, log)
	if err != nil {
		return Tools{}, err
	}
	return toolsIn(entry, strings.TrimSpace(src)), nil
}

// coreDNSRecipe is BuildCoreDNS's recipe (see recipe).
const coreDNSRecipe = "coredns-build-1"

// coreDNSSubdir is the CoreDNS module in the weft repository.
var coreDNSSubdir = filepath.Join("e2e", "conformance", "dns")

// BuildCoreDNS returns the path of the cluster DNS server of the test
// clusters: CoreDNS pinned by e2e/conformance/dns, with the plugins of its
// main.go, built static into the tools cache (a few minutes cold) unless
// the cache has it for that module and Go version.
func BuildCoreDNS(ctx context.Context, log *slog.Logger) (string, error) {
	root, err := kubeapi.RepoRoot()
	if err != nil {
		return "", err
	}
	entry, err := kubeapi.CachedTools{
		Module:   filepath.Join(root, coreDNSSubdir),
		KeyFiles: []string{"go.mod", "go.sum", "main.go"},
		Recipe:   coreDNSRecipe,
		Prefix:   "coredns",
		What:     "CoreDNS (the test clusters' DNS)",
		Tools: []kubeapi.Tool{{Name: "coredns", Note: "a few minutes", Args: func(out string) []string {
			return []string{"build", "-trimpath", "-ldflags", "-s -w", "-o", out, "."}
		}}},
		Nice: true,
	}.Ensure(ctx, log)
	if err != nil {
		return "", err
	}
	return filepath.Join(entry, "coredns"), nil
}

// extraRecipe is BuildExtras' recipe (see recipe).
const extraRecipe = "conformance-extra-1"

// Extras are test images' programs of the pinned source that the network
// specs run besides agnhost, each a static binary in its own image.
type Extras struct {
	// Regression74839 is test/images/regression-issue-74839, the server of
	// the Conntrack spec "proxy implementation should not be vulnerable to
	// the invalid conntrack state bug".
	Regression74839 string
}

// BuildExtras builds Extras from the tools module into a cache entry of
// their own (seconds: the standard library alone), so that adding one
// never invalidates the e2e suite's entry.
func BuildExtras(ctx context.Context, log *slog.Logger) (Extras, error) {
	root, err := kubeapi.RepoRoot()
	if err != nil {
		return Extras{}, err
	}
	entry, err := kubeapi.CachedTools{
		Module:   filepath.Join(root, toolsSubdir),
		KeyFiles: []string{"go.mod", "go.sum", "tools.go"},
		Recipe:   extraRecipe,
		Prefix:   "conformance-extra",
		What:     "the network specs' other test programs",
		Tools: []kubeapi.Tool{{Name: "regression-issue-74839", Note: "seconds", Args: func(out string) []string {
			return []string{"build", "-trimpath", "-ldflags", "-s -w", "-o", out, "k8s.io/kubernetes/test/images/regression-issue-74839"}
		}}},
		Nice: true,
	}.Ensure(ctx, log)
	if err != nil {
		return Extras{}, err
	}
	return Extras{Regression74839: filepath.Join(entry, "regression-issue-74839")}, nil
}
