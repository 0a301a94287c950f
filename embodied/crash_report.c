/* Native backtraces of every thread of a process that dies of a fatal signal.
 *
 * embodied/crash_report.py builds this into a shared library and calls install() in each worker
 * process after Python's faulthandler is enabled. On SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL
 * the handler starts gdb on its own process (vfork + execv: nothing is allocated, so a corrupted
 * heap does not stop it), waits for gdb's "thread apply all bt" to be appended to the report
 * file (60 s at most), then hands the signal to the handler installed before it (faulthandler's,
 * which appends the Python stacks of all threads and passes it on, e.g. to Ray's). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/types.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const int SIGNALS[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL};
#define NSIG_HANDLED (sizeof(SIGNALS) / sizeof(SIGNALS[0]))
#define GDB_TIMEOUT_MS 60000

static struct sigaction previous[NSIG_HANDLED];
static char gdb[4096], report[4096], pid_arg[32], header[256];
static pid_t installed_pid;
static char *argv_gdb[16];
static volatile sig_atomic_t busy = 0;

static void put(int fd, const char *text) {
    size_t left = strlen(text);
    while (left > 0) {
        ssize_t n = write(fd, text, left);
        if (n <= 0) return;
        text += n;
        left -= (size_t)n;
    }
}

static void run_gdb(int sig) {
    int fd = open(report, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0) return;
    char number[12];
    int at = sizeof number - 1;
    number[at] = '\0';
    do number[--at] = (char)('0' + sig % 10); while ((sig /= 10) > 0 && at > 0);
    put(fd, header);
    put(fd, " signal ");
    put(fd, number + at);
    put(fd, ": native backtraces of all threads (gdb)\n");
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0); /* Yama's ptrace_scope 1 */
    pid_t child = vfork();
    if (child == 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        execv(gdb, argv_gdb);
        _exit(127);
    }
    if (child > 0) {
        struct timespec tick = {0, 10 * 1000 * 1000};
        int status, waited = 0;
        while (waitpid(child, &status, WNOHANG) == 0) {
            if (waited >= GDB_TIMEOUT_MS) {
                kill(child, SIGKILL);
                waitpid(child, &status, 0);
                put(fd, "(gdb did not finish within 60 s)\n");
                break;
            }
            nanosleep(&tick, NULL);
            waited += 10;
        }
    }
    put(fd, "\n");
    close(fd);
}

static void pass_on(int sig, siginfo_t *info, void *context) {
    for (size_t i = 0; i < NSIG_HANDLED; i++) {
        if (SIGNALS[i] != sig) continue;
        struct sigaction *prev = &previous[i];
        sigaction(sig, prev, NULL); /* the next handler is in charge from now on */
        if (prev->sa_flags & SA_SIGINFO) {
            if (prev->sa_sigaction != NULL) prev->sa_sigaction(sig, info, context);
        } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
            prev->sa_handler(sig);
        } else {
            raise(sig);
        }
        return;
    }
}

static void handler(int sig, siginfo_t *info, void *context) {
    if (__sync_lock_test_and_set(&busy, 1)) {
        for (;;) pause(); /* another thread is reporting; the process dies with it */
    }
    if (getpid() == installed_pid) run_gdb(sig); /* a forked child would trace its parent */
    pass_on(sig, info, context);
}

/* Install the handler; `gdb_path` and `report_path` are used as given, `label` starts each
 * section written. Returns 0, or -1 when a path is too long. */
int install(const char *gdb_path, const char *report_path, const char *label) {
    if (strlen(gdb_path) >= sizeof gdb || strlen(report_path) >= sizeof report) return -1;
    strcpy(gdb, gdb_path);
    strcpy(report, report_path);
    snprintf(header, sizeof header, "=== %s", label);
    installed_pid = getpid();
    snprintf(pid_arg, sizeof pid_arg, "%d", (int)installed_pid);
    int n = 0;
    argv_gdb[n++] = gdb;
    argv_gdb[n++] = "-nx";
    argv_gdb[n++] = "-batch";
    argv_gdb[n++] = "-iex";
    argv_gdb[n++] = "set auto-load python-scripts off";
    argv_gdb[n++] = "-p";
    argv_gdb[n++] = pid_arg;
    argv_gdb[n++] = "-ex";
    argv_gdb[n++] = "set pagination off";
    argv_gdb[n++] = "-ex";
    argv_gdb[n++] = "thread apply all bt";
    argv_gdb[n] = NULL;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = handler;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < NSIG_HANDLED; i++) sigaction(SIGNALS[i], &action, &previous[i]);
    return 0;
}
