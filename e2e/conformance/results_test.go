package conformance

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A trimmed ginkgo JSON report: a suite node, a passed, a failed, a
// runtime-skipped and a not-selected spec.
const report = `[{"SuiteDescription":"Kubernetes e2e suite","SpecReports":[
 {"LeafNodeType":"SynchronizedBeforeSuite","State":"passed","StartTime":"2026-12-01T16:00:00Z"},
 {"ContainerHierarchyTexts":["[sig-network] Networking","Granular Checks: Pods"],"LeafNodeType":"It","LeafNodeText":"should function for intra-pod communication: http","State":"passed","StartTime":"2026-12-01T16:00:01Z","RunTime":21000000000},
 {"ContainerHierarchyTexts":["[sig-network] Services"],"LeafNodeType":"It","LeafNodeText":"should serve a basic endpoint from pods","State":"failed","StartTime":"2026-12-01T16:00:30Z","RunTime":5000000000,"Failure":{"Message":"timed out\nwaiting"}},
 {"ContainerHierarchyTexts":["[sig-network] Services"],"LeafNodeType":"It","LeafNodeText":"should work after restarting apiserver","State":"skipped","StartTime":"2026-12-01T16:01:00Z","Failure":{"Message":"Only supported for providers [gce gke] (not skeleton)"}},
 {"ContainerHierarchyTexts":["[sig-storage] CSI"],"LeafNodeType":"It","LeafNodeText":"something else","State":"skipped","StartTime":"0001-01-01T00:00:00Z"},
 {"LeafNodeType":"ReportAfterSuite","State":"passed","StartTime":"2026-12-01T16:02:00Z"}
]}]`

func TestSummarize(t *testing.T) {
	r, err := Summarize([]byte(report))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Passed) != 1 || len(r.Failed) != 1 || len(r.Skipped) != 1 || r.NotSelected != 1 {
		t.Fatalf("counts: %d passed, %d failed, %d skipped, %d not selected; want 1 each", len(r.Passed), len(r.Failed), len(r.Skipped), r.NotSelected)
	}
	if want := "[sig-network] Services should serve a basic endpoint from pods"; r.Failed[0].Name != want {
		t.Errorf("failed spec %q, want %q", r.Failed[0].Name, want)
	}
	table := r.Table()
	for _, want := range []string{"1 passed, 1 failed, 1 skipped at run time (1 specs not selected", "FAIL", "timed out waiting", "not skeleton"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
}

func TestSummarizeRejectsBadReports(t *testing.T) {
	for _, in := range []string{"", "{", "[]", `{"SpecReports":[]}`} {
		if _, err := Summarize([]byte(in)); err == nil {
			t.Errorf("Summarize(%q): no error", in)
		}
	}
}

func TestImagesFor(t *testing.T) {
	list := "registry.k8s.io/e2e-test-images/agnhost:2.55\nregistry.k8s.io/e2e-test-images/agnhost:2.66.1\n" +
		"gcr.io/authenticated-image-pulling/e2e-test-images/agnhost:2.6\ninvalid.registry.k8s.io/invalid/pause:3.10.2\n" +
		"registry.k8s.io/pause:3.10.2\nregistry.k8s.io/e2e-test-images/busybox:1.37.0-2\n"
	a, p, err := ImagesFor(list, "2.66.1")
	if err != nil {
		t.Fatal(err)
	}
	if len(a) != 1 || a[0] != "registry.k8s.io/e2e-test-images/agnhost:2.66.1" {
		t.Errorf("agnhost %v", a)
	}
	if len(p) != 1 || p[0] != "registry.k8s.io/pause:3.10.2" {
		t.Errorf("pause %v", p)
	}
	if _, _, err := ImagesFor(list, "2.70"); err == nil {
		t.Error("no error for an agnhost version the list lacks")
	}
}

func TestResolveKeepsEveryLink(t *testing.T) {
	d := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(d, "usr", "bin"), 0o755))
	must(os.WriteFile(filepath.Join(d, "usr", "bin", "nc.openbsd"), []byte("x"), 0o755))
	must(os.Symlink("usr/bin", filepath.Join(d, "bin")))
	must(os.MkdirAll(filepath.Join(d, "etc", "alternatives"), 0o755))
	must(os.Symlink(filepath.Join(d, "bin", "nc.openbsd"), filepath.Join(d, "etc", "alternatives", "nc")))
	must(os.Symlink(filepath.Join(d, "etc", "alternatives", "nc"), filepath.Join(d, "usr", "bin", "nc")))
	real, chain, err := resolve(filepath.Join(d, "usr", "bin", "nc"))
	if err != nil {
		t.Fatal(err)
	}
	realD, _ := filepath.EvalSymlinks(d)
	if want := filepath.Join(realD, "usr", "bin", "nc.openbsd"); real != want {
		t.Errorf("real %s, want %s", real, want)
	}
	for _, l := range []string{"usr/bin/nc", "etc/alternatives/nc", "bin"} {
		if _, ok := chain[filepath.Join(realD, l)]; !ok {
			t.Errorf("link %s missing from %v", l, chain)
		}
	}
}

func TestLayerTar(t *testing.T) {
	files := []entry{
		{Path: "usr/bin/curl", Mode: 0o755, Data: []byte("curl")},
		{Path: "bin", Mode: os.ModeSymlink | 0o777, Link: "usr/bin"},
		{Path: "tmp", Mode: os.ModeDir | os.ModeSticky | 0o777},
	}
	data, err := layerTar(files, time.Unix(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*tar.Header{}
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got[h.Name] = h
	}
	if h := got["bin"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "usr/bin" {
		t.Errorf("bin: %+v", h)
	}
	if h := got["tmp/"]; h == nil || h.Mode != 0o1777 {
		t.Errorf("tmp/: %+v", h)
	}
	if got["usr/"] == nil || got["usr/bin/"] == nil || got["usr/bin/curl"] == nil {
		t.Errorf("missing entries: %v", got)
	}
	for _, bad := range [][]entry{
		{{Path: "/abs", Mode: 0o644}},
		{{Path: "a/../b", Mode: 0o644}},
		{{Path: "x", Mode: 0o644}, {Path: "x", Mode: 0o644}},
		{{Path: "l", Mode: os.ModeSymlink, Link: "y"}, {Path: "l/f", Mode: 0o644}},
	} {
		if _, err := layerTar(bad, time.Unix(0, 0)); err == nil {
			t.Errorf("layerTar(%v): no error", bad)
		}
	}
}
