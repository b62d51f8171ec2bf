package kubeapi

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// KubeVersion is the Kubernetes version the tools module pins; the binaries
// are linked to report it (clients refuse a server whose version they cannot
// parse).
const KubeVersion = "v1.37.2"

// buildRecipe changes whenever the way the binaries are built changes (flags,
// names), so that a new recipe never reuses an old cache entry.
const buildRecipe = "kubeapi-build-2"

// Tool is one binary of a cache entry: its file name in the entry and the
// package of the tools module that builds it.
type Tool struct {
	Name string
	Pkg  string
	Note string // said while building, e.g. "a few minutes"
	// Args, if set, are the go command's arguments that build the tool
	// into out; else `go build` of Pkg with Ldflags.
	Args func(out string) []string
}

func (t Tool) args(out string) []string {
	if t.Args != nil {
		return t.Args(out)
	}
	return []string{"build", "-trimpath", "-ldflags", Ldflags(), "-o", out, t.Pkg}
}

// kubeKeyFiles are the files of the tools module the control plane's cache
// key hashes.
var kubeKeyFiles = []string{"go.mod", "go.sum", filepath.Join("etcd", "main.go")}

// Tools are the binaries Binaries builds, in build order.
var Tools = []Tool{
	{Name: "etcd", Pkg: "github.com/weft-net/weft/e2e/kubeapi/tools/etcd", Note: "about a minute"},
	{Name: "kube-apiserver", Pkg: "k8s.io/kubernetes/cmd/kube-apiserver", Note: "first time, a few minutes"},
	{Name: "kubectl", Pkg: "k8s.io/kubernetes/cmd/kubectl", Note: "a minute or two"},
	// The rest of a cluster, for the real-node harness (e2e/kubenodes):
	// the same pinned version as the API server.
	{Name: "kube-controller-manager", Pkg: "k8s.io/kubernetes/cmd/kube-controller-manager", Note: "first time, a few minutes"},
	{Name: "kube-scheduler", Pkg: "k8s.io/kubernetes/cmd/kube-scheduler", Note: "a minute or two"},
	{Name: "kubelet", Pkg: "k8s.io/kubernetes/cmd/kubelet", Note: "first time, a few minutes"},
	{Name: "kube-proxy", Pkg: "k8s.io/kubernetes/cmd/kube-proxy", Note: "a minute or two"},
}

// Ldflags stamps the Kubernetes version into the kube binaries (component-base
// for the server and kubectl's client version, client-go's for its user
// agent) and strips the symbol tables to keep the cache small.
func Ldflags() string {
	minor := strings.Split(strings.TrimPrefix(KubeVersion, "v"), ".")[1]
	var b strings.Builder
	b.WriteString("-s -w")
	for _, pkg := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		fmt.Fprintf(&b, " -X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean",
			pkg, KubeVersion, pkg, pkg, minor, pkg)
	}
	return b.String()
}

// Bins are the paths of the control-plane binaries.
type Bins struct {
	Dir       string // the cache entry that holds them
	Etcd      string
	APIServer string
	Kubectl   string

	ControllerManager string
	Scheduler         string
	Kubelet           string
	KubeProxy         string
}

func binsIn(dir string) Bins {
	return Bins{
		Dir:       dir,
		Etcd:      filepath.Join(dir, "etcd"),
		APIServer: filepath.Join(dir, "kube-apiserver"),
		Kubectl:   filepath.Join(dir, "kubectl"),

		ControllerManager: filepath.Join(dir, "kube-controller-manager"),
		Scheduler:         filepath.Join(dir, "kube-scheduler"),
		Kubelet:           filepath.Join(dir, "kubelet"),
		KubeProxy:         filepath.Join(dir, "kube-proxy"),
	}
}

// cacheKey is the first 12 hex digits of the sha256 of the tools module's
// files (for the control plane: go.mod, go.sum and the etcd wrapper), the
// Go version that builds them, the build recipe and the link flags.
func cacheKey(toolsDir string, files []string, goVersion, recipe string) (string, error) {
	h := sha256.New()
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(toolsDir, f))
		if err != nil {
			return "", fmt.Errorf("kubeapi: reading the tools module: %w", err)
		}
		fmt.Fprintf(h, "%s %d\n", f, len(data))
		h.Write(data)
	}
	fmt.Fprintf(h, "go %s\nrecipe %s\nldflags %s\n", goVersion, recipe, Ldflags())
	return hex.EncodeToString(h.Sum(nil))[:12], nil
}

// cacheRoot is $WEFT_TOOLS_CACHE, else /var/cache/weft-tools for root and
// the user's cache directory for anyone else.
func cacheRoot() (string, error) {
	if d := os.Getenv("WEFT_TOOLS_CACHE"); d != "" {
		return filepath.Abs(d)
	}
	if os.Geteuid() == 0 {
		return "/var/cache/weft-tools", nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("kubeapi: no cache directory for the control-plane binaries (set WEFT_TOOLS_CACHE): %w", err)
	}
	return filepath.Join(d, "weft-tools"), nil
}

// weftModule is the module path findToolsDir looks for.
const weftModule = "github.com/weft-net/weft"

// toolsSubdir is where the tools module sits in the weft repository.
var toolsSubdir = filepath.Join("e2e", "kubeapi", "tools")

// findToolsDir returns e2e/kubeapi/tools of the weft repository that holds
// the working directory.
func findToolsDir() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, toolsSubdir), nil
}

// DeployDir is deploy/ of the weft repository (weft.yaml, kustomization.yaml).
func DeployDir() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, "deploy"), nil
}

// RepoRoot is the root of the weft repository that holds the working
// directory (tests run in their package's directory, `go run` and make at
// the root), found by walking up to its go.mod.
func RepoRoot() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("kubeapi: finding the weft repository: %w", err)
	}
	for dir := wd; ; dir = filepath.Dir(dir) {
		if moduleOf(filepath.Join(dir, "go.mod")) == weftModule {
			return dir, nil
		}
		if filepath.Dir(dir) == dir {
			return "", fmt.Errorf("kubeapi: %s is not inside the %s repository (the tools module %s and deploy/ are found from there); run from inside it", wd, weftModule, toolsSubdir)
		}
	}
}

// moduleOf returns the module path declared in a go.mod, or "".
func moduleOf(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if f := strings.Fields(s.Text()); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`)
		}
	}
	return ""
}
